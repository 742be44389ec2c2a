"""Data sources: tables in three formats, string labels, subsets, digits, per-batch padding."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import minilm_folder

from compress.data.datasets import collate, load_data
from compress.recipe.datasets import resolve_data
from compress.recipe.schema import Recipe


def _recipe(source: str, **data) -> Recipe:
    return Recipe.model_validate({
        "name": "t", "model": {"source": "compress.models.zoo:mlp"},
        "data": {"source": source, "text_column": "sentence", **data},
        "stages": [{"kind": "finetune"}]})


def test_sst2_mirror_through_compress_data_dir(data_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = _recipe("stanfordnlp/sst2", eval={"split": "validation"},
                     train={"split": "train", "max_samples": 100})
    data = load_data(recipe, resolve_data("stanfordnlp/sst2"))
    assert len(data.splits["eval"]) == 872 and len(data.splits["train"]) == 100
    assert set(data.splits["eval"].labels) == {0, 1}


def test_text_batches_are_padded_to_their_longest_item(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from compress.data.datasets import Examples

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    examples = Examples(labels=[0, 1, 0], texts=["short", "a somewhat longer sentence here",
                                                  "word " * 300])
    inputs, labels = collate(examples, [0, 1], tokenizer, max_length=64)
    assert inputs["input_ids"].shape == (2, 7)  # [CLS] + 5 words + [SEP], not 64
    assert inputs["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert labels.tolist() == [0, 1]
    long_inputs, _ = collate(examples, [2], tokenizer, max_length=64)
    assert long_inputs["input_ids"].shape == (1, 64)  # truncated
    assert isinstance(long_inputs["input_ids"], torch.Tensor)


