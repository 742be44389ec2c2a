"""TensorRT fp16 export of a BERT classifier (torch-tensorrt, dynamo), loaded back in its
runtime and compared with the fp32 model it came from. The model is made here (a tiny BERT
with a word-level tokenizer written on the spot), so the test runs on a GPU machine that
has neither the shipped MiniLM nor the SST-2 mirror."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_tensorrt", reason="torch-tensorrt is not installed: "
                    "pip install -e '.[tensorrt]' (benchmarks/gpu/check.sh tries it)")

WORDS = ["good", "great", "fine", "bad", "awful", "dull", "movie", "film", "a", "the"]


@pytest.fixture(scope="module")
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


def test_tensorrt_fp16_export_matches_the_fp32_model(word_bert: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from compress.models.bundle import ModelBundle
    from compress.recipe.kinds.export import ExportConfig
    from export.folder import load_export, write_export

    model = AutoModelForSequenceClassification.from_pretrained(word_bert).eval()
    tokenizer = AutoTokenizer.from_pretrained(word_bert)
    bundle = ModelBundle(model, "hf", ["negative", "positive"], tokenizer=tokenizer)
    cfg = ExportConfig(kind="export", format="tensorrt", precision="fp16",
                       shapes={"min": [1, 4], "opt": [8, 16], "max": [16, 64]})
    path, facts = write_export(bundle, cfg, tmp_path / "trt", log=lambda _: None)
    assert path.is_file() and facts["trt_precision"] == "fp16"
    loaded = load_export(tmp_path / "trt")
    texts = ["a good film", "the movie was dull and awful", "great", "bad bad bad movie"]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded).logits
    got = loaded.model(**encoded)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 2e-2  # fp16 against fp32
