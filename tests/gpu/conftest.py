"""The GPU tier: every test here needs CUDA and is skipped with the reason without it.

Self-contained on purpose: the models are made in the test (a tiny BERT with a word-level
tokenizer written on the spot), so the tier runs on a GPU machine that has torch and
transformers but neither the shipped MiniLM nor the SST-2 mirror."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
WORDS = ["good", "great", "fine", "bad", "awful", "dull", "movie", "film", "a", "the"]


def pytest_collection_modifyitems(config, items) -> None:
    """Skip every GPU test, with the reason, where CUDA is absent."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def word_bert(tmp_path_factory) -> Path:
    """A 2-layer, 64-wide random BERT classifier with a word-level tokenizer, as a local
    Hugging Face folder."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("word_bert")
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(special + WORDS) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    config = BertConfig(vocab_size=len(special) + len(WORDS), hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=256, num_labels=2)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
