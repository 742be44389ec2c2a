"""The shipped recipes end to end: real MiniLM on (shrunk) SST-2, the digits CNN in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.integration


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def test_bert_finetune_shrunk_learns_sst2_and_reruns_cached(tmp_path: Path,
                                                           data_dir: Path) -> None:
    args = ["run", str(REPO / "recipes/bert_finetune.yaml"), f"output_dir={tmp_path}",
            "data.train.max_samples=1600", "data.eval.max_samples=200",
            "stages.0.checkpoint_every=10", "stages.0.learning_rate=2e-4",
            "evaluation.latency.iters=3",
            "evaluation.latency.warmup=1"]
    env = {"COMPRESS_DATA_DIR": str(data_dir)}
    result = run_cli(*args, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = _manifest(tmp_path / "bert_finetune")
    baseline = manifest["baseline"]["metrics"]
    stage = manifest["stages"][0]
    assert manifest["data"] == {"eval": 200, "train": 1600}
    assert stage["metrics"]["train_steps"] == 50
    assert stage["metrics"]["accuracy"] >= 0.75, stage["metrics"]
    assert stage["metrics"]["accuracy"] > baseline["accuracy"] + 0.15
    assert stage["metrics"]["params"] == baseline["params"] > 22_000_000
    assert stage["metrics"]["latency_seq_len"] == 128
    model_dir = tmp_path / "bert_finetune" / "00-finetune" / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}

    again = run_cli(*args, env=env)
    assert again.returncode == 0
    assert "baseline: cached" in again.stderr and "finetune: cached" in again.stderr
    assert _manifest(tmp_path / "bert_finetune")["stages"][0]["status"] == "cached"


def test_cnn_digits_recipe_reaches_95_percent(tmp_path: Path) -> None:
    result = run_cli("run", str(REPO / "recipes/cnn_digits.yaml"), "--output-dir",
                     str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = _manifest(tmp_path / "cnn_digits")
    stage = manifest["stages"][0]
    assert manifest["data"]["eval"] == 360
    assert stage["metrics"]["accuracy"] >= 0.95, stage["metrics"]
    assert stage["metrics"]["macro_f1"] >= 0.95
