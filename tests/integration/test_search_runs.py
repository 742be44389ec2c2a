"""The search stage end to end: a search killed with SIGKILL resumes without repeating its
finished trials, a wider tolerance reuses every trial, and recipes/bert_search.yaml
(shrunk, real MiniLM on SST-2) packages the fastest trial within its tolerance."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from conftest import (
    REPO,
    SHRUNK_SST2,
    run_cli,
    start_and_kill,
    write_recipe,
    write_sentiment_tables,
)

pytestmark = pytest.mark.integration


def _search_json(run_dir: Path, index: int) -> dict:
    return json.loads((run_dir / f"{index:02d}-search/search.json").read_text())


def test_a_killed_search_resumes_and_a_wider_tolerance_reuses_every_trial(
        tiny_bert: Path, tmp_path: Path) -> None:
    data = write_sentiment_tables(tmp_path / "data")
    search = {"kind": "search", "max_accuracy_drop": 0.0, "final_rounds": 0,
              "candidates": ["onnx_fp32", "aoti_fp32", "ort_dynamic_int8"]}
    path = write_recipe(tmp_path / "r.yaml", {
        "name": "killed", "model": {"source": str(tiny_bert)},
        "data": {"source": str(data), "text_column": "sentence", "label_column": "label",
                 "eval": {"split": "validation"},
                 "calibration": {"split": "train", "max_samples": 32}},
        "stages": [search],
        "evaluation": {"baseline": False,
                       "latency": {"batch_sizes": [8], "iters": 2, "warmup": 1}},
        "output_dir": str(tmp_path / "runs")})
    run_dir = tmp_path / "runs/killed"
    trials = run_dir / "00-search/trials"
    # killed while the AOTInductor trial is being compiled
    start_and_kill(path, lambda: bool(list(trials.glob("*/trial.json"))), timeout=300)
    finished = {p.parent.name: p.stat().st_mtime_ns for p in trials.glob("*/trial.json")}
    assert len(finished) == 1 and next(iter(finished)).startswith("onnx_fp32-")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"][0]["status"] == "running"

    again = run_cli("run", str(path))
    assert again.returncode == 0, again.stderr[-2000:]
    record = _search_json(run_dir, 0)
    assert record["trials_cached"] == 1 and record["trials_run"] == 2
    assert {p.parent.name: p.stat().st_mtime_ns for p in trials.glob("*/trial.json")
            if p.parent.name in finished} == finished  # not built again
    assert f"{next(iter(finished))} (cached)" in again.stderr
    assert len(record["trials"]) == 3 and all(t["status"] == "ok" for t in record["trials"])

    wider = run_cli("search", str(path), "--max-drop", "5")
    assert wider.returncode == 0, wider.stderr[-2000:]
    record = _search_json(run_dir, 0)
    assert record["max_accuracy_drop"] == 5 and record["trials_run"] == 0
    assert record["trials_cached"] == 3 and record["winner"] is not None


def test_bert_search_recipe_packages_the_fastest_trial_within_the_tolerance(
        data_dir: Path, tmp_path: Path) -> None:
    candidates = "[pt2e_static_aoti, ort_dynamic_int8, onnx_fp32]"
    args = ["run", str(REPO / "recipes/bert_search.yaml"), f"output_dir={tmp_path}",
            *SHRUNK_SST2, "stages.0.max_steps=40", "stages.0.learning_rate=2e-4",
            f"stages.1.candidates={candidates}", "stages.1.calibration.samples=64",
            "stages.1.sensitivity_samples=32", "stages.1.max_fallback_layers=2",
            "stages.1.max_trials=5", "stages.1.final_rounds=2"]
    result = run_cli(*args, env={"COMPRESS_DATA_DIR": str(data_dir)})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "bert_search"
    record = _search_json(run_dir, 1)
    trials = [t for t in record["trials"] if t["status"] == "ok"]
    assert {t["candidate"] for t in trials} >= {"pt2e_static_aoti", "ort_dynamic_int8",
                                                "onnx_fp32"}
    ref = record["reference"]["accuracy"]
    for t in trials:  # every trial measured the same way, on the whole (shrunk) split
        assert t["drop"] == pytest.approx(100 * (ref - t["accuracy"]), abs=1e-3)
        assert t["within"] == (t["drop"] <= 0.5 + 1e-9)
        assert t["latency_ms_b1"] > 0 and t["latency_ms_b8"] > 0 and t["bytes"] > 0
    winner = next(t for t in trials if t["id"] == record["winner"])
    within = [t for t in trials if t["within"]]
    key = "final_ms" if "final_ms" in winner else "latency_ms_b8"
    assert winner[key] == min(t.get(key, float("inf")) for t in within)
    assert all(t.get("lost") for t in record["trials"] if t is not winner)
    int8 = next(t for t in trials if t["candidate"] == "ort_dynamic_int8" and
                not t["float_layers"])
    assert int8["bytes"] < 0.4 * next(t for t in trials if t["candidate"] == "onnx_fp32")[
        "bytes"]

    manifest = json.loads((run_dir / "manifest.json").read_text())
    stage = manifest["stages"][1]
    assert stage["metrics"]["search_winner_trial"] == winner["id"]
    assert stage["outputs"][0]["export_dir"].startswith(f"01-search/trials/{winner['id']}/")
    mar = run_dir / "02-package/bert_search.mar"
    with zipfile.ZipFile(mar) as archive:
        summary = json.loads(archive.read("compress.json"))
        assert winner["file"] in archive.namelist()
    assert summary["artifact"]["stage"] == "search"
    report = (run_dir / "report.md").read_text()
    assert "## Search: latency_b8 within 0.5 point" in report and f"**{winner['id']}**" in report
    assert (run_dir / "01-search/search.png").stat().st_size > 10_000
    if record["sensitivity"]:
        ranking = json.loads((run_dir / "01-search/sensitivity.json").read_text())["ranking"]
        assert len(ranking) == 38 and ranking[0]["kl"] >= ranking[-1]["kl"]
