"""Reports: built from the manifest alone, written after every run (finished or not),
compared across runs, and plotted with the Pareto front."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import digits_recipe, run_cli, write_recipe

from compress.report.build import build_report, compare, render_markdown


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two digits runs: finetune -> ONNX export (done), and finetune -> an ONNX Runtime
    int8 export held to an impossible tolerance (fails) -> a TorchScript export (never runs)."""
    out = tmp_path_factory.mktemp("report")
    done = digits_recipe(out / "runs")
    done["stages"].append({"kind": "export", "format": "onnx", "name": "onnx_fp32"})
    result = run_cli("run", str(write_recipe(out / "done.yaml", done)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "report: report.json, report.md, report.png in" in result.stderr
    failed = digits_recipe(out / "runs")
    failed["name"] = "tiny_digits_failed"
    # int8: ONNX Runtime's fp32 MLP can match torch bit for bit (AVX512 Xeon: 0.0)
    failed["stages"] += [{"kind": "export", "format": "onnx", "quantize": "dynamic",
                          "tolerance": 1e-12},
                         {"kind": "export", "format": "torchscript", "name": "ts"}]
    result = run_cli("run", str(write_recipe(out / "failed.yaml", failed)))
    assert result.returncode == 1
    return out / "runs"


def test_report_lists_every_artifact_with_the_manifest_metrics(runs: Path) -> None:
    run_dir = runs / "tiny_digits"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    written = json.loads((run_dir / "report.json").read_text())
    report = build_report(run_dir)
    assert [r["name"] for r in report["rows"]] == ["baseline", "finetune", "onnx_fp32"]
    assert [r["name"] for r in written["rows"]] == ["baseline", "finetune", "onnx_fp32"]
    assert report["rows"][0]["metrics"] == manifest["baseline"]["metrics"]
    for row, stage in zip(report["rows"][1:], manifest["stages"], strict=True):
        assert row["metrics"] == stage["metrics"] and row["status"] == "done"
    assert report["reference"] == "finetune"  # the recipe starts by fine-tuning
    finetune, onnx = report["rows"][1:]
    assert onnx["runtime"] == "ONNX Runtime" and onnx["artifact"].endswith("model.onnx")
    m, r = onnx["metrics"], finetune["metrics"]
    assert onnx["speedup_b8"] == round(r["latency_ms_b8"] / m["latency_ms_b8"], 2)
    assert onnx["items_per_s_b8"] == round(8000 / m["latency_ms_b8"], 1)
    assert onnx["accuracy_delta_pt"] == round(100 * (m["accuracy"] - r["accuracy"]), 2)
    assert finetune["accuracy_delta_pt"] == 0.0 and finetune["size_ratio"] == 1.0
    assert report["header"]["cores"] >= 1 and "torch" in report["header"]["libraries"]
    assert report["header"]["chain"] == ["finetune", "onnx_fp32"]
    baseline_report = build_report(run_dir, reference="baseline")
    assert baseline_report["rows"][0]["speedup_b8"] == 1.0


def test_markdown_renders_as_one_table_row_per_artifact(runs: Path) -> None:
    text = (runs / "tiny_digits" / "report.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0].startswith("| artifact | runtime | status | acc % | Δ pt | F1 |")
    assert set(table[1]) == {"|", "-"} and table[1].count("|") == table[0].count("|")
    assert [line.split("|")[1].strip() for line in table[2:]] == [
        "baseline", "finetune", "onnx_fp32"]
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "**" in text  # the best value of each column is bold


def test_a_failed_and_a_missing_stage_are_reported_and_marked(runs: Path) -> None:
    run_dir = runs / "tiny_digits_failed"
    report = json.loads((run_dir / "report.json").read_text())  # written although it failed
    rows = {r["name"]: r for r in report["rows"]}
    assert [r["status"] for r in report["rows"]] == ["done", "done", "failed", "not run"]
    assert "parity" in rows["export"]["error"] and rows["ts"]["metrics"] == {}
    assert rows["export"]["metrics"]["parity_max_abs_diff"] > 1e-12
    text = (run_dir / "report.md").read_text()
    assert "| ts | TorchScript | not run |" in text and "Failed stages:" in text
    assert (run_dir / "report.png").is_file()


def test_cli_report_formats_and_no_torch_import(runs: Path, tmp_path: Path) -> None:
    run_dir = runs / "tiny_digits"
    table = run_cli("report", str(run_dir))
    assert table.returncode == 0 and "onnx_fp32" in table.stdout and "b8 ms p50/p90" in table.stdout
    as_json = run_cli("report", str(run_dir), "--format", "json")
    assert json.loads(as_json.stdout)["run"] == "tiny_digits"
    out = tmp_path / "r.md"
    written = run_cli("report", str(run_dir), "--format", "markdown", "--output", str(out))
    assert written.returncode == 0 and out.read_text().startswith("# compress report")
    code = ("import sys; from compress.report.build import build_report, render_markdown; "
            f"render_markdown(build_report({str(run_dir)!r})); "
            "assert 'torch' not in sys.modules, 'report imported torch'")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    missing = run_cli("report", str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"error: {tmp_path}: no manifest.json; is it a run folder? (compress run RECIPE "
        f"makes one)")
    bad = run_cli("report", str(run_dir), "--reference", "nope")
    assert bad.returncode == 2 and "--reference nope: no such row" in bad.stderr


def test_compare_two_runs_with_different_stages(runs: Path) -> None:
    both = compare([runs / "tiny_digits", runs / "tiny_digits_failed"])
    names = [r["name"] for r in both["rows"]]
    assert names == ["tiny_digits/baseline", "tiny_digits/finetune", "tiny_digits/onnx_fp32",
                     "tiny_digits_failed/baseline", "tiny_digits_failed/finetune",
                     "tiny_digits_failed/export", "tiny_digits_failed/ts"]
    text = render_markdown(both)
    assert "tiny_digits_failed/ts" in text and "**" in text
    result = run_cli("compare", str(runs / "tiny_digits"), str(runs / "tiny_digits_failed"))
    assert result.returncode == 0 and "tiny_digits_failed/export" in result.stdout
    alone = run_cli("compare", str(runs / "tiny_digits"))
    assert alone.returncode == 2 and "at least two run folders" in alone.stderr


def test_bench_times_artifacts_in_fresh_processes_and_the_report_shows_it(runs: Path) -> None:
    run_dir = runs / "tiny_digits"
    result = run_cli("bench", str(run_dir), "--stage", "onnx_fp32", "--iters", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("onnx_fp32: b1 ")
    bench = json.loads((run_dir / "bench.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())
    onnx = report["rows"][2]
    assert onnx["fresh_p50_ms_b8"] == bench["artifacts"]["onnx_fp32"]["latency_ms_b8"] > 0
    assert "fresh_p50_ms_b8" not in report["rows"][1]  # finetune was not benched
    assert "fresh process b8 ms" in (run_dir / "report.md").read_text()
    more = run_cli("bench", str(run_dir), "--stage", "finetune", "--iters", "3")
    assert more.returncode == 0 and more.stdout.startswith("finetune: b1 ")
    both = json.loads((run_dir / "bench.json").read_text())["artifacts"]
    assert both["onnx_fp32"] == bench["artifacts"]["onnx_fp32"]  # kept, not timed again
    assert both["finetune"]["latency_ms_b8"] > 0 and both["finetune"]["measured"]
    unknown = run_cli("bench", str(run_dir), "--stage", "nope")
    assert unknown.returncode == 2 and "no artifact named nope" in unknown.stderr
