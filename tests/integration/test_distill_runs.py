"""Distillation: the KD loss by hand, student construction, and a stage run on a tiny BERT."""

from __future__ import annotations

from pathlib import Path


def _text_recipe(tiny_bert: Path, sentiment_dir: Path, out: Path, student: dict) -> dict:
    return {
        "name": "tiny_distill",
        "model": {"source": str(tiny_bert)},
        "data": {"source": str(sentiment_dir), "text_column": "sentence", "max_length": 16},
        "stages": [
            {"kind": "finetune", "epochs": 2, "batch_size": 16, "learning_rate": 1e-3},
            {"kind": "distill", "student": student, "epochs": 2, "batch_size": 16,
             "learning_rate": 1e-3, "temperature": 2.0, "alpha": 0.5},
        ],
        "evaluation": {"latency": {"batch_sizes": [1], "seq_len": 16, "iters": 2}},
        "output_dir": str(out),
    }


def test_distill_stage_end_to_end(tiny_bert: Path, sentiment_dir: Path, tmp_path: Path) -> None:
    import json

    from conftest import run_cli, write_recipe

    raw = _text_recipe(tiny_bert, sentiment_dir, tmp_path / "runs", {"layers": 1})
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr[-1500:]
    manifest = json.loads((tmp_path / "runs/tiny_distill/manifest.json").read_text())
    teacher, student = (s["metrics"] for s in manifest["stages"])
    assert student["teacher_layers"] == 2 and student["student_layers"] == 1
    assert student["params"] < teacher["params"] == student["teacher_params"]
    assert student["accuracy"] >= 0.9, student  # the toy task is easy; the student learns it
    config = json.loads((tmp_path / "runs/tiny_distill/01-distill/model/config.json").read_text())
    assert config["num_hidden_layers"] == 1


def test_too_many_student_layers_fails_validation(tiny_bert: Path, sentiment_dir: Path,
                                                  tmp_path: Path) -> None:
    from conftest import run_cli, write_recipe

    raw = _text_recipe(tiny_bert, sentiment_dir, tmp_path / "runs", {"layers": 3})
    result = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "stages.1.student.layers: 3 layers, but the teacher has 2" in result.stderr
