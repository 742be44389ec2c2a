"""A causal-LM recipe's `evaluation.lm_eval`: lm-eval's local tasks (recipes/tasks) scored for
the model before any stage and after each, shown in `compress report`, equal to lm-eval's
`compress` model on the run's export folder; an unknown task is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli, write_recipe

pytest.importorskip("lm_eval")

from compress.families.causal_lm.evaluation_harness import CompressLM  # noqa: E402
from compress.pipeline.loop import run_recipe  # noqa: E402
from compress.recipe.schema import load_recipe  # noqa: E402
from compress.report.build import build_report  # noqa: E402
from compress.report.render import render_markdown  # noqa: E402

TASKS = ["sst2_local", "sst2_rolling"]


def recipe_file(tmp_path: Path, model: Path, tasks: list[str]) -> Path:
    raw = {"name": "tiny_eval", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 8}},
           "evaluation": {"generation": {"prompts": 2, "max_new_tokens": 4, "batch_sizes": [1],
                                         "compile": "none", "eager_generate": False,
                                         "cache_len": 128},
                          "latency": {"enabled": False},
                          "lm_eval": {"tasks": tasks, "limit": 12}},
           "stages": [{"kind": "quantize", "scheme": "int8_grouped", "activations": "float32"},
                      {"kind": "export", "format": "transformers"}],
           "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "tiny_eval.yaml", raw)


def test_lm_eval_tasks_are_scored_for_every_stage_and_reported(
        tmp_path: Path, smol_tokenizer_llama_folder: Path, data_dir: Path, monkeypatch) -> None:
    import lm_eval

    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = load_recipe(recipe_file(tmp_path, smol_tokenizer_llama_folder, TASKS),
                         check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    measured = [manifest["baseline"]["metrics"]] + [s["metrics"] for s in manifest["stages"]]
    for metrics in measured:
        assert 0 <= metrics["lm_eval_sst2_local_acc"] <= 1
        assert metrics["lm_eval_sst2_rolling_word_perplexity"] > 1
    report = build_report(run_dir)
    assert [r["lm_eval_sst2_local_acc"] for r in report["rows"]] == [
        m["lm_eval_sst2_local_acc"] for m in measured]
    table = render_markdown(report)
    assert "sst2_local_acc" in table and "sst2_rolling_word_perplexity" in table
    # lm-eval's own run of the `compress` model on the exported folder: the same scores
    folder = run_dir / "01-export" / "transformers"
    from lm_eval.tasks import TaskManager

    from compress.families.causal_lm.evaluation_harness import LOCAL_TASKS

    offline = lm_eval.simple_evaluate(
        model="compress", model_args=f"folder={folder}", tasks=TASKS, limit=12,
        task_manager=TaskManager(include_path=str(LOCAL_TASKS)))["results"]
    exported = measured[-1]
    assert offline["sst2_local"]["acc,none"] == pytest.approx(
        exported["lm_eval_sst2_local_acc"], abs=1e-6)  # the metric is kept to 6 digits
    assert offline["sst2_rolling"]["word_perplexity,none"] == pytest.approx(
        exported["lm_eval_sst2_rolling_word_perplexity"], rel=1e-4)
    assert isinstance(CompressLM(str(folder)).prefix_token, int)


def test_an_unknown_task_is_one_line(tmp_path: Path, smol_tokenizer_llama_folder: Path,
                                     data_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    code, _, err = cli(monkeypatch, capsys, "run",
                       str(recipe_file(tmp_path, smol_tokenizer_llama_folder, ["sst3"])))
    assert code != 0
    assert "evaluation.lm_eval: task 'sst3' not found" in err
    assert "sst2_local" in err and "Traceback" not in err
