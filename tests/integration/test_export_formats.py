"""Export stages: each format written, loaded in its own runtime, and proven against the
model it came from; leaf semantics in the pipeline; bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import export_text_recipe, run_in_process
from conftest import digits_recipe, write_recipe

from compress.errors import StageError, UserError
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe

pytest.importorskip("onnxruntime")


def _run(tmp_path: Path, raw: dict) -> dict:
    return run_in_process(write_recipe(tmp_path / "r.yaml", raw))


def test_every_export_is_done_with_parity_figures(exported_text_run) -> None:
    run_dir, manifest = exported_text_run
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


def test_exports_are_leaves_and_cached(exported_text_run) -> None:
    run_dir, manifest = exported_text_run
    finetune_sha = manifest["stages"][0]["outputs"][0]["sha256"]
    for stage in manifest["stages"][1:]:
        assert stage["inputs"][0]["sha256"] == finetune_sha  # each export takes the model
        assert (run_dir / stage["outputs"][0]["path"]).is_file()
    recipe = load_recipe(run_dir.parent.parent / "r.yaml")
    messages: list[str] = []
    run_recipe(recipe, echo=messages.append)
    assert sum("cached" in m for m in messages) == 6, messages  # baseline + 5 stages


@pytest.mark.parametrize("batch,length", [(1, 8), (32, 256)])
def test_onnx_runs_in_a_fresh_session_at_any_batch_and_length(exported_text_run, batch,
                                                              length) -> None:
    import onnxruntime as ort

    run_dir, _ = exported_text_run
    session = ort.InferenceSession(str(run_dir / "02-export/onnx/model.onnx"),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(1000, 2000, (batch, length)),
            "attention_mask": np.ones((batch, length), dtype=np.int64),
            "token_type_ids": np.zeros((batch, length), dtype=np.int64)}
    wanted = {i.name for i in session.get_inputs()}
    (logits,) = session.run(["logits"], {k: v for k, v in feed.items() if k in wanted})
    assert logits.shape == (batch, 2) and np.isfinite(logits).all()
    meta = json.loads((run_dir / "02-export/onnx/export.json").read_text())
    assert meta["inputs"] == ["input_ids", "attention_mask", "token_type_ids"]


def test_onnx_dynamic_int8_quantizes_every_matmul_with_one_scale_per_weight(
        exported_text_run) -> None:
    """Optimum's --avx512_vnni recipe: the attention's activation-by-activation MatMuls in
    int8 too, one scale per weight tensor (more accurate and faster on the bert_int8
    MiniLM than per-channel, weight-only MatMuls)."""
    import onnx
    from onnx import numpy_helper

    run_dir, _ = exported_text_run
    graph = onnx.load(str(run_dir / "03-export/onnx/model.onnx")).graph
    ops = [node.op_type for node in graph.node]
    assert "MatMul" not in ops and ops.count("MatMulInteger") >= 12  # 2 layers x 6
    scales = [numpy_helper.to_array(t) for t in graph.initializer
              if t.name.endswith("_scale") and "weight" in t.name.lower()]
    assert scales and all(scale.size == 1 for scale in scales)


def test_torchscript_loads_with_plain_torch(exported_text_run) -> None:
    from transformers import AutoTokenizer

    run_dir, _ = exported_text_run
    folder = run_dir / "01-export/torchscript"
    module = torch.jit.load(str(folder / "model.ts"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(["a lovely warm film", "dull"], padding=True, return_tensors="pt")
    logits = module(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert logits.shape == (2, 2)


def test_parity_beyond_tolerance_fails_keeps_the_file(tiny_bert: Path, sentiment_dir: Path,
                                                      tmp_path: Path) -> None:
    raw = export_text_recipe(tiny_bert, sentiment_dir, tmp_path / "runs",
                       [{"kind": "export", "format": "onnx", "tolerance": 1e-15,
                         "exporter": "torchscript"}])
    raw["stages"][0]["epochs"] = 1
    with pytest.raises(StageError) as info:
        _run(tmp_path, raw)
    assert "parity check failed on 80 eval examples: max |logit difference|" in info.value.cause
    manifest = json.loads((tmp_path / "runs/tiny_export/manifest.json").read_text())
    stage = manifest["stages"][1]
    assert stage["status"] == "failed" and stage["outputs"] == []
    assert stage["metrics"]["parity_max_abs_diff"] > 1e-15
    assert (tmp_path / "runs/tiny_export/01-export/onnx/model.onnx").is_file()
    assert not list((tmp_path / "runs/tiny_export/01-export").glob(".*tmp"))


