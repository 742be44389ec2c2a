"""Shapes in the search on a tiny BERT: smaller students trained once each (distilled, fine-
tuned on the labels alone, pruned with recovery), every candidate tried on each, their
cache keys, and a shape's training resumed after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import run_in_process
from conftest import run_cli, start_and_kill, write_recipe, write_sentiment_tables

pytestmark = pytest.mark.integration

SHAPES = [{"layers": 1}, {"layers": 1, "teacher": False}, {"ffn": 0.5}]


def _recipe(tmp_path: Path, model: Path, steps: int = 6, checkpoint_every: int = 2,
            **search) -> Path:
    data = write_sentiment_tables(tmp_path / "data")
    stage = {"kind": "search", "max_accuracy_drop": 50.0, "final_rounds": 0,
             "candidates": ["onnx_fp32", "ort_dynamic_int8"], "shapes": SHAPES,
             "shape_training": {"max_steps": steps, "batch_size": 8, "learning_rate": 1e-3,
                                "checkpoint_every": checkpoint_every,
                                "recovery": {"max_steps": 4, "batch_size": 8}},
             **search}
    return write_recipe(tmp_path / "r.yaml", {
        "name": "shapes", "model": {"source": str(model)},
        "data": {"source": str(data), "text_column": "sentence", "label_column": "label",
                 "max_length": 16, "train": {"split": "train"},
                 "eval": {"split": "validation"},
                 "calibration": {"split": "train", "max_samples": 32}},
        "stages": [stage],
        "evaluation": {"baseline": False,
                       "latency": {"batch_sizes": [8], "iters": 2, "warmup": 1}},
        "output_dir": str(tmp_path / "runs")})


def _search(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "runs/shapes/00-search/search.json").read_text())


def test_every_candidate_is_tried_on_every_shape_and_all_is_cached_after(
        tiny_bert: Path, tmp_path: Path) -> None:
    path = _recipe(tmp_path, tiny_bert)
    manifest = run_in_process(path)
    record = _search(tmp_path)
    shapes = {s["label"]: s for s in record["shapes"]}
    assert list(shapes) == ["L1-direct", "all-ffn50", "L1"]  # cheapest to train first
    assert shapes["L1"]["layers"] == shapes["L1-direct"]["layers"] == 1
    assert shapes["L1"]["distill_steps"] == 6 and shapes["L1-direct"]["finetune_steps"] == 6
    assert shapes["all-ffn50"]["layers"] == 2
    assert shapes["all-ffn50"]["params"] < shapes["L1"]["params"] * 2
    assert not any(s["cached"] for s in shapes.values())
    by_shape: dict[str | None, set[str]] = {}
    for t in record["trials"]:
        assert t["status"] == "ok", t
        by_shape.setdefault(t["shape"], set()).add(t["candidate"])
        assert t["id"].startswith(f"{t['shape']}-") if t["shape"] else True
    assert by_shape == {s: {"onnx_fp32", "ort_dynamic_int8"}
                        for s in (None, "all-ffn50", "L1-direct", "L1")}
    assert record["trials_run"] == 8 and record["winner"] is not None
    section = (tmp_path / "runs/shapes/00-search/section.md").read_text()
    assert "Shape L1-direct: 1 of 2 layers" in section
    assert manifest["stages"][0]["metrics"]["search_trials"] == 8

    # the same recipe again: the stage is cached; forced, every shape and trial is reused
    forced = run_cli("run", str(path), "--force")
    assert forced.returncode == 0, forced.stderr[-2000:]
    record = _search(tmp_path)
    assert record["trials_run"] == 0 and record["trials_cached"] == 8
    assert all(s["cached"] for s in record["shapes"])

    # another shape training: the shapes are trained again, the entering model's trials not
    changed = path.read_text().replace("max_steps: 6", "max_steps: 5")
    path.write_text(changed)
    again = run_cli("run", str(path))
    assert again.returncode == 0, again.stderr[-2000:]
    record = _search(tmp_path)
    assert not any(s["cached"] for s in record["shapes"])
    assert record["trials_cached"] == 2 and record["trials_run"] == 6
    assert {t["shape"] for t in record["trials"] if t["cached"]} == {None}


def test_a_shape_killed_while_it_trains_resumes_from_its_checkpoint(
        tiny_bert: Path, tmp_path: Path) -> None:
    # a checkpoint every 25 steps, not 2: 200 saved (and synced) checkpoints were most of
    # the 400 steps' time; the run is killed at its first
    path = _recipe(tmp_path, tiny_bert, steps=400, checkpoint_every=25, shapes=[{"layers": 1}])
    shapes = tmp_path / "runs/shapes/00-search/shapes"
    start_and_kill(path, lambda: bool(list(shapes.glob("*/checkpoints/distill/*.pt"))),
                   timeout=300)
    again = run_cli("run", str(path))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from" in again.stderr
    record = _search(tmp_path)
    assert record["shapes"][0]["distill_steps"] == 400
