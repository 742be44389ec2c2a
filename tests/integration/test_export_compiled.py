"""Export stages: each format written, loaded in its own runtime, and proven against the
model it came from; leaf semantics in the pipeline; bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import digits_recipe, write_recipe

from compress.errors import UserError
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


def test_every_export_is_done_with_parity_figures(text_run) -> None:
    run_dir, manifest = text_run
    finetune, torchscript, onnx_fp32, dynamic, static = manifest["stages"]
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 5
    assert finetune["metrics"]["accuracy"] >= 0.9
    assert torchscript["metrics"]["parity_max_abs_diff"] <= 1e-5
    assert onnx_fp32["metrics"]["parity_max_abs_diff"] <= 1e-4
    for stage in (torchscript, onnx_fp32):
        metrics = stage["metrics"]
        assert metrics["parity_argmax_agreement"] == 1.0
        assert metrics["parity_samples"] == manifest["data"]["eval"] == 80
        assert metrics["accuracy"] == finetune["metrics"]["accuracy"]
        assert metrics["latency_ms_b8"] > 0 and metrics["params"] == finetune["metrics"]["params"]
    for stage in (dynamic, static):
        metrics = stage["metrics"]
        assert metrics["onnx_quantize"] in ("dynamic", "static")
        assert metrics["parity_tolerance"] is None and metrics["parity_max_accuracy_drop"] == 1.5
        assert abs(metrics["accuracy"] - finetune["metrics"]["accuracy"]) <= 0.05
    assert onnx_fp32["metrics"]["onnx_fused_ops"]  # the optimizer fused something
    assert dynamic["outputs"][0]["bytes"] < onnx_fp32["outputs"][0]["bytes"] / 2
    assert json.loads((run_dir / "03-export/onnx/parity.json").read_text())[
        "parity_samples"] == 80


def test_aoti_of_float_and_int8_models(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["data"]["calibration"] = {"split": "train", "max_samples": 128}
    raw["stages"] += [
        {"kind": "export", "format": "aoti", "name": "aoti_fp32"},
        {"kind": "quantize", "mode": "static", "calibration": {"samples": 128,
                                                               "batch_size": 64}},
        {"kind": "export", "format": "aoti", "name": "aoti_int8"},
    ]
    manifest = _run(tmp_path, raw)
    finetune, fp32, quantized, int8 = (s["metrics"] for s in manifest["stages"])
    assert fp32["parity_max_abs_diff"] <= 1e-4 and fp32["parity_argmax_agreement"] == 1.0
    assert int8["parity_tolerance"] is None  # an int8 source: agreement is what counts
    assert int8["parity_argmax_agreement"] >= 0.995
    assert int8["accuracy"] == pytest.approx(quantized["accuracy"], abs=0.01)
    package = tmp_path / "runs/tiny_digits" / manifest["stages"][3]["outputs"][0]["path"]
    assert package.name == "model.aoti.pt2"
    model = torch._inductor.aoti_load_package(str(package))
    for batch in (1, 5):
        assert model(torch.rand(batch, 1, 8, 8)).shape == (batch, 10)


def test_export_of_an_earlier_stage_by_source(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="source: '0' is not an earlier stage that makes a model"):
        load_recipe(write_recipe(tmp_path / "bad.yaml", {
            **digits_recipe(tmp_path / "runs"),
            "stages": [{"kind": "export", "format": "onnx", "source": 0}]}))
    raw = digits_recipe(tmp_path / "runs")
    raw["data"]["calibration"] = {"split": "train", "max_samples": 64}
    raw["stages"] += [{"kind": "quantize", "mode": "dynamic"},
                      {"kind": "export", "format": "onnx", "source": "finetune"}]
    manifest = _run(tmp_path, raw)
    finetune, _, onnx_stage = manifest["stages"]
    assert onnx_stage["inputs"][0]["sha256"] == finetune["outputs"][0]["sha256"]
    assert onnx_stage["metrics"]["parity_max_abs_diff"] <= 1e-4
