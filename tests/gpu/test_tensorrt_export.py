"""TensorRT fp16 export of a BERT classifier (torch-tensorrt, dynamo), loaded back in its
runtime and compared with the fp32 model it came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_tensorrt", reason="torch-tensorrt is not installed: "
                    "pip install -e '.[tensorrt]' (benchmarks/gpu_check.sh tries it)")


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
