"""Issue 75 item 4: an embedding recipe's `evaluation.mteb`: MTEB's local tasks scored for the
model before any stage and after each, shown in `compress report`, equal (within 1e-3) to
`compress mteb` on the run's export folder, the folder read as its server reads it; an
unknown task is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, write_recipe

pytest.importorskip("mteb")

from compress.pipeline.loop import run_recipe  # noqa: E402
from compress.recipe.schema import load_recipe  # noqa: E402
from compress.report.build import build_report  # noqa: E402
from compress.report.render import render_markdown  # noqa: E402

pytestmark = pytest.mark.integration

TASKS = ["SST2LocalClassification", "SST2KnownItemRetrieval"]
SCORES = ["mteb_SST2LocalClassification_accuracy", "mteb_SST2KnownItemRetrieval_ndcg_at_10"]
LIMIT = 60


def recipe_file(tmp_path: Path, model: Path, tasks: list[str]) -> Path:
    raw = {"name": "tiny_mteb", "model": {"source": str(model), "task": "embedding"},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 64,
                    "eval": {"split": "validation", "max_samples": 16}},
           "evaluation": {"batch_size": 32, "latency": {"enabled": False},
                          "mteb": {"tasks": tasks, "limit": LIMIT}},
           "stages": [{"kind": "export", "name": "fp32_onnx", "format": "onnx"},
                      {"kind": "export", "name": "int8_onnx", "format": "onnx",
                       "quantize": "dynamic"}],
           "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "tiny_mteb.yaml", raw)


def test_mteb_tasks_are_scored_for_every_stage_and_reported(
        tmp_path: Path, cls_bert_folder: Path, data_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = load_recipe(recipe_file(tmp_path, cls_bert_folder, TASKS), check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    measured = [manifest["baseline"]["metrics"]] + [s["metrics"] for s in manifest["stages"]]
    for metrics in measured:
        assert all(0 < metrics[key] <= 1 for key in SCORES), metrics
    report = build_report(run_dir)
    assert [[row[key] for key in SCORES] for row in report["rows"]] == [
        [metrics[key] for key in SCORES] for metrics in measured]
    table = render_markdown(report)
    assert "SST2LocalClassification_accuracy" in table
    assert "SST2KnownItemRetrieval_ndcg_at_10" in table
    # `compress mteb` on the int8 export folder: the scores its stage reported
    out = tmp_path / "scores.json"
    code, printed, err = cli(monkeypatch, capsys, "mteb", str(run_dir / "01-export" / "onnx"),
                             "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
                             "--output", str(out))
    assert code == 0, err
    offline = json.loads(out.read_text())
    assert set(offline) == set(SCORES) and "SST2KnownItemRetrieval_ndcg_at_10" in printed
    assert all(abs(offline[key] - measured[-1][key]) <= 1e-3 for key in SCORES), (
        offline, measured[-1])


def test_an_unknown_task_is_one_line(tmp_path: Path, cls_bert_folder: Path, data_dir: Path,
                                     monkeypatch, capsys) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    code, _, err = cli(monkeypatch, capsys, "run",
                       str(recipe_file(tmp_path, cls_bert_folder, ["SST3Classification"])))
    assert code == 2
    assert "evaluation.mteb: MTEB task 'SST3Classification' not found" in err
    assert "Traceback" not in err
