"""benchmarks/classifier/peers.py on a finished tiny-BERT run shaped like
recipes/bert_int8.yaml: every artifact gets a row with accuracy and latency figures, a
second run's artifacts join the table (a file of both timed once), the GEMM peaks are
measured, and a folder that is not a run is refused with one line (exit 2).
Optimum is left out (--no-peers): the tests need no package index."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli, write_recipe, write_sentiment_tables

pytest.importorskip("onnxruntime")

PEERS = "benchmarks.classifier.peers"  # python -m PEERS from the repository root
# the GEMM peaks on one small shape: on a CPU without AVX512-BF16 or VNNI the default shapes'
# emulated bf16 and _int_mm products took 60-100 s a GEMM run, two runs an invocation
SMALL_GEMM = ("--gemm-shape", "128x384x384")


def tiny_int8_recipe(model: Path, data: Path, out: Path) -> dict:
    """recipes/bert_int8.yaml's chain on a tiny BERT: fine-tune, static int8, the int8
    model as an AOTInductor package, the fp32 model as ONNX."""
    return {
        "name": "tiny_int8",
        "model": {"source": str(model)},
        "data": {"source": str(data), "text_column": "sentence", "max_length": 32,
                 "label_names": ["negative", "positive"],
                 "calibration": {"split": "train", "max_samples": 32}},
        "stages": [
            {"kind": "finetune", "epochs": 2, "batch_size": 16, "learning_rate": 1e-3},
            {"kind": "quantize", "mode": "static",
             "calibration": {"samples": 32, "batch_size": 16}},
            {"kind": "export", "name": "int8_aoti", "format": "aoti"},
            {"kind": "export", "name": "fp32_onnx", "format": "onnx", "source": "finetune"},
        ],
        "evaluation": {"baseline": False,
                       "latency": {"batch_sizes": [8], "seq_len": 16, "iters": 2,
                                   "warmup": 1}},
        "output_dir": str(out),
        "seed": 0,
    }


@pytest.fixture(scope="module")
def tiny_int8_run(tiny_bert: Path, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("peers")
    data = write_sentiment_tables(tmp / "sentiment", n_train=96, n_eval=40)
    raw = tiny_int8_recipe(tiny_bert, data, tmp / "runs")
    result = run_cli("run", str(write_recipe(tmp / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr[-2000:]
    return tmp / "runs" / "tiny_int8"


def _peers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", PEERS, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=900)


def test_every_artifact_gets_a_row_and_another_run_joins_without_repeating_a_file(
        tiny_int8_run: Path, tmp_path: Path) -> None:
    """Every artifact of the run gets a row; with --with-run a second recipe on the same
    model (here fine-tune + an fp32 TorchScript file: no compile, the cheapest export) adds
    its artifacts as RUN/NAME, and a file the first run has is not timed twice. One
    invocation: each costs two GEMM runs and a process an artifact."""
    raw = yaml.safe_load((tiny_int8_run / "recipe.yaml").read_text())
    raw.update(name="tiny_fp32", output_dir=str(tmp_path / "runs"),
               stages=[raw["stages"][0], {"kind": "export", "name": "fp32_ts",
                                          "format": "torchscript"}])
    done_run = run_cli("run", str(write_recipe(tmp_path / "fp32.yaml", raw)))
    assert done_run.returncode == 0, done_run.stderr[-2000:]
    other = tmp_path / "runs" / "tiny_fp32"
    markdown, figures = tmp_path / "peers.md", tmp_path / "peers.json"
    done = _peers(str(tiny_int8_run), "--with-run", str(other), "--no-peers", "--rounds", "1",
                  "--iters", "2", "--warmup", "1", "--real-limit", "16", *SMALL_GEMM,
                  "--markdown", str(markdown), "--json", str(figures))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(figures.read_text())
    rows = {row["artifact"]: row for row in result["rows"]}
    first = json.loads((tiny_int8_run / "manifest.json").read_text())["stages"][0]
    again = json.loads((other / "manifest.json").read_text())["stages"][0]
    same = first["outputs"][0]["sha256"] == again["outputs"][0]["sha256"]
    joined = ["tiny_fp32/fp32_ts"] + ([] if same else ["tiny_fp32/finetune"])
    assert sorted(rows) == sorted(["finetune", "quantize", "int8_aoti", "fp32_onnx", *joined])
    assert list(rows)[:4] == ["finetune", "quantize", "int8_aoti", "fp32_onnx"]
    for name, row in rows.items():
        assert not row.get("error"), name
        assert 0 <= row["accuracy"] <= 1 and row["accuracy_pct"] == 100 * row["accuracy"]
        for key in ("latency_ms_b1", "latency_ms_b8", "latency_ms_b1_real",
                    "latency_ms_b8_real", "size_mb", "flops", "pct_int8_peak"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key)
        assert row["real_tokens_b8"] <= 32  # the eval sentences, padded per batch
        assert row["speedup_b8"] is None  # no Optimum row to divide by
    pids = {item["rounds"][0]["pid"] for item in result["artifacts"]}
    assert len(pids) == len(rows)  # a fresh process each
    gemm = result["header"]["gemm"]
    assert all(gemm[k] > 0 for k in ("fp32_gflops", "bf16_gflops", "int8_torch_gops",
                                     "int8_ort_gops"))
    assert gemm["int8_gops"] == max(gemm["int8_torch_gops"], gemm["int8_ort_gops"])
    assert [list(run["shapes"]) for run in result["gemm_runs"]] == [["128x384x384"]] * 2
    assert result["settings"]["seq_len"] == 128 and result["settings"]["iters"] == 2
    text = markdown.read_text()
    assert all(f"| {name} |" in text for name in rows)
    assert "int8 GEMM" in text or "GEMM peaks" in text
    printed = [line for line in done.stdout.splitlines() if line.strip()]
    # the heading and one line per artifact, then the winner's two ratios to each peer:
    # with --no-peers every peer (Optimum, OpenVINO; on the teacher and on the student)
    # is "not measured", never a figure
    assert len(printed[:1 + len(rows)]) == 1 + len(rows)
    assert printed[1 + len(rows)] == "the winner against each peer at its best:"
    ratios = printed[1 + len(rows) + 2:]
    assert len(ratios) == 4 and all("not measured" in line for line in ratios)
    assert {line.split()[0] for line in ratios} == {"product", "like"}


def test_a_folder_that_is_not_a_run_is_refused(tmp_path: Path) -> None:
    done = _peers(str(tmp_path), "--no-peers", "--markdown", str(tmp_path / "p.md"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "manifest.json" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "p.md").exists()
    missing = _peers(str(tmp_path / "nope"), "--no-peers")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")
    assert len(missing.stderr.strip().splitlines()) == 1
