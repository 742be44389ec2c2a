"""Export stages: each format written, loaded in its own runtime, and proven against the
model it came from; leaf semantics in the pipeline; bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_recipe

from compress.errors import StageError
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


@pytest.mark.parametrize("batch,length", [(1, 8), (32, 256)])
def test_onnx_runs_in_a_fresh_session_at_any_batch_and_length(text_run, batch, length) -> None:
    import onnxruntime as ort

    run_dir, _ = text_run
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


def test_onnx_dynamic_int8_quantizes_every_matmul_with_one_scale_per_weight(text_run) -> None:
    """Optimum's --avx512_vnni recipe: the attention's activation-by-activation MatMuls in
    int8 too, one scale per weight tensor (more accurate and faster on the bert_int8
    MiniLM than per-channel, weight-only MatMuls)."""
    import onnx
    from onnx import numpy_helper

    run_dir, _ = text_run
    graph = onnx.load(str(run_dir / "03-export/onnx/model.onnx")).graph
    ops = [node.op_type for node in graph.node]
    assert "MatMul" not in ops and ops.count("MatMulInteger") >= 12  # 2 layers x 6
    scales = [numpy_helper.to_array(t) for t in graph.initializer
              if t.name.endswith("_scale") and "weight" in t.name.lower()]
    assert scales and all(scale.size == 1 for scale in scales)


def test_torchscript_loads_with_plain_torch(text_run) -> None:
    from transformers import AutoTokenizer

    run_dir, _ = text_run
    folder = run_dir / "01-export/torchscript"
    module = torch.jit.load(str(folder / "model.ts"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(["a lovely warm film", "dull"], padding=True, return_tensors="pt")
    logits = module(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert logits.shape == (2, 2)


def test_parity_beyond_tolerance_fails_keeps_the_file(tiny_bert: Path, sentiment_dir: Path,
                                                      tmp_path: Path) -> None:
    raw = _text_recipe(tiny_bert, sentiment_dir, tmp_path / "runs",
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


