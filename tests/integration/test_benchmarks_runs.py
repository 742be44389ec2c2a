"""benchmarks/headline/run.py: its ratios are the manifest's own numbers, divided as
documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHRUNK_SST2, digits_recipe, run_cli, write_recipe

from benchmarks.headline import run as headline


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> tuple[Path, Path]:
    """A real run: an MLP on digits fine-tuned, PT2E static int8, fp32 ONNX and ONNX Runtime
    dynamic int8 (both exported from the fine-tuned model). (recipe file, run folder)."""
    tmp = tmp_path_factory.mktemp("bench")
    recipe = digits_recipe(tmp / "runs")
    recipe["name"] = "digits_bench"
    recipe["stages"] += [
        {"kind": "quantize", "mode": "static", "calibration": {"samples": 64, "batch_size": 32}},
        {"kind": "export", "format": "onnx", "name": "fp32_onnx", "source": "finetune"},
        {"kind": "export", "format": "onnx", "name": "onnx_int8", "source": "finetune",
         "quantize": "dynamic", "max_accuracy_drop": 100},
    ]
    path = write_recipe(tmp / "digits_bench.yaml", recipe)
    result = run_cli("run", str(path))
    assert result.returncode == 0, result.stderr[-2000:]
    return path, tmp / "runs" / "digits_bench"


def _stages(run_dir: Path) -> dict[str, dict]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {s["name"]: s["metrics"] for s in manifest["stages"]}


def test_ratios_are_the_manifest_medians_divided(digits_run) -> None:
    _, run_dir = digits_run
    m = _stages(run_dir)
    rows = headline.headline_rows({"digits": run_dir})
    by_pair = {(r["stage"], r["reference"]): r for r in rows}
    assert set(by_pair) == {("quantize", "finetune"), ("fp32_onnx", "finetune"),
                            ("onnx_int8", "finetune"), ("onnx_int8", "fp32_onnx")}
    assert all(r["status"] == "ok" and r["batch"] == 8 for r in rows)
    ft = m["finetune"]
    # the reference entered the stage: both medians from that stage's process
    for stage in ("quantize", "fp32_onnx", "onnx_int8"):
        row, s = by_pair[(stage, "finetune")], m[stage]
        assert row["timing"] == "same process"
        assert row["latency_ms"] == s["latency_ms_b8"]
        assert row["reference_latency_ms"] == s["input_latency_ms_b8"]
        assert row["latency_ratio"] == s["latency_ms_b8"] / s["input_latency_ms_b8"]
        assert row["accuracy_delta_pt"] == 100 * (s["accuracy"] - ft["accuracy"])
        assert row["size_ratio"] == s["size_mb"] / ft["size_mb"]
        assert row["noisy"] == bool(row["notes"][:-1])
        if 8 in s.get("latency_noisy_batches", []):
            assert "noisy b8" in row["notes"]
    # ONNX Runtime int8 against the fp32 ONNX export: each stage's own median
    row, s, fp32 = by_pair[("onnx_int8", "fp32_onnx")], m["onnx_int8"], m["fp32_onnx"]
    assert row["timing"] == "separate timings"
    assert row["latency_ratio"] == s["latency_ms_b8"] / fp32["latency_ms_b8"]
    assert row["accuracy_delta_pt"] == 100 * (s["accuracy"] - fp32["accuracy"])
    assert row["size_ratio"] == s["size_mb"] / fp32["size_mb"]
    assert by_pair[("quantize", "finetune")]["runtime"] == "PT2E int8 static, torch.compile"
    assert row["runtime"] == "ONNX Runtime int8 dynamic"


def test_missing_run_folder_is_reported_not_raised(digits_run, tmp_path: Path) -> None:
    _, run_dir = digits_run
    runs = {"digits": run_dir, "bert_int8": tmp_path / "never_ran"}
    rows = headline.headline_rows(runs)
    missing = [r for r in rows if r["recipe"] == "bert_int8"]
    assert [r["status"] for r in missing] == ["missing"]
    assert "no readable manifest.json" in missing[0]["notes"][0]
    text = headline.render(rows, headline.hardware(runs))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cores = manifest["environment"]["cpu"]["cores"]
    assert f"{cores} cores" in text and "bert_int8/-" in text and "MISSING" in text
    assert "digits/quantize" in text and "digits/onnx_int8" in text


def test_main_reuses_the_cached_run_and_fails_on_a_missing_recipe(digits_run, tmp_path: Path,
                                                                  capsys) -> None:
    recipe, run_dir = digits_run
    out = tmp_path / "figures.json"
    code = headline.main(["--recipes", str(recipe), "does_not_exist", "--runs-dir",
                          str(run_dir.parent), "--skip-serve", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 1  # the missing recipe
    assert "does_not_exist: FAILED" in printed.out
    assert "digits_bench: done" in printed.err and "(4 cached stages)" in printed.err
    figures = json.loads(out.read_text())
    assert figures["recipes"]["digits_bench"]["status"] == "ok"
    assert figures["rows"] == headline.headline_rows({"digits_bench": run_dir})


def test_shrink_overrides_match_the_tests_and_validate(data_dir: Path) -> None:
    assert headline.SHRUNK_SST2 == SHRUNK_SST2
    for name in headline.DEFAULT_RECIPES:
        overrides = headline.recipe_overrides(name, shrink=True)
        assert overrides[:len(SHRUNK_SST2)] == SHRUNK_SST2
        result = run_cli("validate", str(headline.recipe_path(name)), *overrides,
                         env={"COMPRESS_DATA_DIR": str(data_dir)})
        assert result.returncode == 0, (name, result.stdout, result.stderr)
    assert headline.recipe_overrides("bert_int8", shrink=False) == []
