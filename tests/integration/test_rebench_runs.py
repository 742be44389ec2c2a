"""Fresh-process benchmarking of a finished run, and the text sequence-length sweep."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import digits_recipe, run_cli, write_recipe

from compress.errors import UserError
from compress.report.rebench import artifacts_of, bench_fresh

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    """A finished digits run: finetune, then an ONNX export (seq_lens set: not text)."""
    tmp = tmp_path_factory.mktemp("rebench")
    raw = digits_recipe(tmp / "runs")
    raw["stages"].append({"kind": "export", "format": "onnx"})
    raw["evaluation"]["latency"]["seq_lens"] = [16]
    result = run_cli("run", str(write_recipe(tmp / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp / "runs" / raw["name"]


def _assert_timed(metrics: dict) -> None:
    for batch in (1, 8):
        assert metrics[f"latency_ms_b{batch}"] > 0
        assert metrics[f"latency_ms_b{batch}_p90"] >= metrics[f"latency_ms_b{batch}"]


def test_artifacts_of_lists_models_and_exports(digits_run: Path) -> None:
    assert [(a["name"], a["kind"], a["folder"]) for a in artifacts_of(digits_run)] \
        == [("finetune", "finetune", "00-finetune/model"),
            ("export", "export", "01-export/onnx")]


def test_every_artifact_is_timed_in_its_own_process(digits_run: Path) -> None:
    lines: list[str] = []
    result = bench_fresh(digits_run, echo=lines.append)
    assert json.loads((digits_run / "bench.json").read_text()) == result
    assert result["fresh_process"] is True and result["measured"]
    assert result["settings"]["iters"] == 3 and result["settings"]["warmup"] == 1
    artifacts = result["artifacts"]
    assert list(artifacts) == ["finetune", "export"]
    for metrics in artifacts.values():
        _assert_timed(metrics)
        assert not any("_s16" in key for key in metrics)  # seq_lens: text models only
    pids = {metrics["pid"] for metrics in artifacts.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    assert artifacts["export"]["folder"] == "01-export/onnx"
    assert any(line.startswith("bench: export: latency_ms_b1 ") for line in lines)
    manifest = json.loads((digits_run / "manifest.json").read_text())
    assert not any("_s16" in key for key in manifest["stages"][0]["metrics"])


def test_overrides_and_selection(digits_run: Path) -> None:
    if not (digits_run / "bench.json").is_file():  # this test alone: every artifact first
        bench_fresh(digits_run, iters=1, warmup=0, echo=lambda _: None)
    result = bench_fresh(digits_run, names=["1"], iters=2, warmup=0, threads=1,
                         echo=lambda _: None)
    assert result["timed"] == ["export"]
    assert list(result["artifacts"]) == ["finetune", "export"]  # the finetune figures kept
    assert result["settings"] | {"iters": 2, "warmup": 0, "threads": 1} == result["settings"]
    assert result["artifacts"]["export"]["latency_threads"] == 1


def test_bad_names_and_folders_are_refused(digits_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no artifact named nope .*choices: finetune, export"):
        bench_fresh(digits_run, names=["finetune", "nope"])
    with pytest.raises(UserError, match="iters"):
        bench_fresh(digits_run, iters=0)
    with pytest.raises(UserError, match="manifest.json"):
        bench_fresh(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "x", "stages": []}))
    with pytest.raises(UserError, match="no finished stage"):
        bench_fresh(tmp_path)


def test_a_missing_artifact_fails_alone(digits_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(digits_run, copy)
    shutil.rmtree(copy / "00-finetune" / "model")
    result = bench_fresh(copy, echo=lambda _: None)
    error = result["artifacts"]["finetune"]["error"]
    assert "00-finetune/model is missing" in error and "\n" not in error
    _assert_timed(result["artifacts"]["export"])
    assert json.loads((copy / "bench.json").read_text()) == result


