"""Fresh-process benchmarking of a finished run, and the text sequence-length sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_recipe, write_sentiment_tables

from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from compress.report.rebench import bench_fresh

pytest.importorskip("onnxruntime")


def test_seq_lens_time_text_models_at_each_length(tiny_bert: Path, tmp_path: Path) -> None:
    data = write_sentiment_tables(tmp_path / "sentiment", n_train=64, n_eval=32)
    raw = {
        "name": "tiny_seq",
        "model": {"source": str(tiny_bert)},
        "data": {"source": str(data), "text_column": "sentence", "max_length": 32},
        "stages": [{"kind": "finetune", "epochs": 1, "batch_size": 16,
                    "learning_rate": 1e-3}],
        "evaluation": {"baseline": False,
                       "latency": {"batch_sizes": [1], "seq_len": 16, "seq_lens": [16, 32],
                                   "iters": 2, "warmup": 1}},
        "output_dir": str(tmp_path / "runs"),
    }
    run_dir = run_recipe(load_recipe(write_recipe(tmp_path / "r.yaml", raw)),
                         echo=lambda _: None)
    metrics = json.loads((run_dir / "manifest.json").read_text())["stages"][0]["metrics"]
    assert metrics["latency_seq_len"] == 16 and metrics["latency_ms_b1"] > 0
    for length in (16, 32):
        median = metrics[f"latency_ms_b1_s{length}"]
        assert 0 < median <= metrics[f"latency_ms_b1_s{length}_p90"]
    fresh = bench_fresh(run_dir, echo=lambda _: None)["artifacts"]["finetune"]
    assert fresh["latency_ms_b1_s32"] > 0 and fresh["latency_seq_len"] == 16
