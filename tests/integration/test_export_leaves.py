"""Export stages: each format written, loaded in its own runtime, and proven against the
model it came from; leaf semantics in the pipeline; bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_recipe

from compress.recipe.schema import load_recipe
from compress.run.pipeline import run_recipe

pytest.importorskip("onnxruntime")


def _run(tmp_path: Path, raw: dict) -> dict:
    """Run a recipe in this process; return its manifest."""
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", raw))
    run_dir = run_recipe(recipe, echo=lambda _: None)
    return json.loads((run_dir / "manifest.json").read_text())


def _text_recipe(tiny_bert: Path, sentiment_dir: Path, out: Path, exports: list[dict]) -> dict:
    return {
        "name": "tiny_export",
        "model": {"source": str(tiny_bert)},
        "data": {"source": str(sentiment_dir), "text_column": "sentence", "max_length": 32,
                 "calibration": {"split": "train", "max_samples": 64}},
        "stages": [{"kind": "finetune", "epochs": 6, "batch_size": 16, "learning_rate": 1e-3},
                   *exports],
        "evaluation": {"latency": {"batch_sizes": [1, 8], "seq_len": 16, "iters": 2,
                                   "warmup": 1}},
        "output_dir": str(out),
    }


@pytest.fixture(scope="module")
def text_run(tiny_bert: Path, tmp_path_factory) -> tuple[Path, dict]:
    """finetune -> torchscript, onnx (optimized), onnx dynamic int8, onnx static QDQ int8."""
    from conftest import write_sentiment_tables

    tmp = tmp_path_factory.mktemp("export")
    data = write_sentiment_tables(tmp / "sentiment")
    raw = _text_recipe(tiny_bert, data, tmp / "runs", [
        {"kind": "export", "format": "torchscript"},
        {"kind": "export", "format": "onnx", "name": "onnx_fp32", "optimize": True},
        {"kind": "export", "format": "onnx", "name": "onnx_dynamic", "quantize": "dynamic"},
        {"kind": "export", "format": "onnx", "name": "onnx_static", "quantize": "static",
         "calibration": {"samples": 64, "batch_size": 16}},
    ])
    return tmp / "runs" / "tiny_export", _run(tmp, raw)


def test_exports_are_leaves_and_cached(text_run) -> None:
    run_dir, manifest = text_run
    finetune_sha = manifest["stages"][0]["outputs"][0]["sha256"]
    for stage in manifest["stages"][1:]:
        assert stage["inputs"][0]["sha256"] == finetune_sha  # each export takes the model
        assert (run_dir / stage["outputs"][0]["path"]).is_file()
    recipe = load_recipe(run_dir.parent.parent / "r.yaml")
    messages: list[str] = []
    run_recipe(recipe, echo=messages.append)
    assert sum("cached" in m for m in messages) == 6, messages  # baseline + 5 stages


