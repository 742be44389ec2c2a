"""The runner: run folder layout, manifest, caching (a stage runs again when its code changes),
--force/--from-stage, failures, kill -9."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from conftest import digits_recipe, run_cli, start_and_kill, write_recipe
from safetensors.torch import load_file

from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from compress.runfolder import code_digest
from compress.runfolder.files import sha256_file

METRIC_KEYS = {"accuracy", "macro_f1", "latency_ms_b1", "latency_ms_b8", "size_mb", "params",
               "sparsity"}


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _stage_statuses(run_dir: Path) -> list[str]:
    return [stage["status"] for stage in _manifest(run_dir)["stages"]]


def test_run_writes_a_self_describing_folder(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "tiny_digits"
    assert (run_dir / "recipe.yaml").is_file() and (run_dir / "00-finetune").is_dir()
    manifest = _manifest(run_dir)
    env = manifest["environment"]
    assert env["libraries"]["torch"].startswith("2.13")
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"):
        assert env["cpu"]["isa"][flag] is (flag in flags), flag  # recorded as the CPU says
    assert env["threads"] >= 1
    assert set(manifest["baseline"]["metrics"]) >= METRIC_KEYS
    stage = manifest["stages"][0]
    assert stage["name"] == "finetune" and stage["kind"] == "finetune"
    assert stage["status"] == "done" and stage["config"]["learning_rate"] == 0.01
    assert set(stage["metrics"]) >= METRIC_KEYS
    assert stage["metrics"]["accuracy"] > 0.9 > manifest["baseline"]["metrics"]["accuracy"]
    assert stage["metrics"]["params"] == 64 * 32 + 32 + 32 * 10 + 10
    out = stage["outputs"][0]
    weights = run_dir / out["path"]
    assert out["format"] == "safetensors" and out["sha256"] == sha256_file(weights)
    assert out["bytes"] == weights.stat().st_size
    assert stage["inputs"][0]["format"] == "source" and stage["wall_time_s"] > 0
    assert not (run_dir / "00-finetune" / "checkpoints").exists()
    assert len(load_file(str(weights))) == 4
    assert "done in" in result.stderr and "finetune" in result.stderr


def test_rerun_is_cached_and_config_change_reruns(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    path = write_recipe(tmp_path / "r.yaml", raw)
    assert run_cli("run", str(path)).returncode == 0
    run_dir = tmp_path / "runs" / "tiny_digits"
    first = _manifest(run_dir)["stages"][0]

    again = run_cli("run", str(path))
    assert again.returncode == 0
    assert "baseline: cached" in again.stderr and "[1/1] finetune: cached" in again.stderr
    cached = _manifest(run_dir)["stages"][0]
    assert cached["status"] == "cached" and cached["outputs"] == first["outputs"]

    forced = run_cli("run", str(path), "--from-stage", "finetune")
    assert "finetune: done" in forced.stderr and "baseline: cached" in forced.stderr

    changed = run_cli("run", str(path), "stages.0.learning_rate=0.02")
    assert changed.returncode == 0 and "finetune: done" in changed.stderr
    assert _manifest(run_dir)["stages"][0]["config"]["learning_rate"] == 0.02

    everything = run_cli("run", str(path), "--force")
    assert "baseline: measuring" in everything.stderr and "finetune: done" in everything.stderr


def test_damaged_artifact_is_not_reused(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", digits_recipe(tmp_path / "runs"))
    assert run_cli("run", str(path)).returncode == 0
    weights = tmp_path / "runs/tiny_digits/00-finetune/model/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    result = run_cli("run", str(path))
    assert result.returncode == 0 and "finetune: done" in result.stderr


def test_bad_from_stage(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", digits_recipe(tmp_path / "runs"))
    result = run_cli("run", str(path), "--from-stage", "prune")
    assert result.returncode == 2 and "no such stage (stages: finetune)" in result.stderr
    assert not (tmp_path / "runs").exists()


def _recipe_whose_training_raises(tmp_path: Path, error: str, prelude: str = "") -> Path:
    """A digits recipe whose model raises `error` (an expression, after the module's
    `prelude`) on its first training step, and evaluates like a Linear otherwise."""
    raw = digits_recipe(tmp_path / "runs")
    raw["model"] = {"source": "failing_model:build"}
    (tmp_path / "failing_model.py").write_text(
        "import torch\n" + prelude +
        "class Fails(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.linear = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        f"        if self.training: raise {error}\n"
        "        return self.linear(x.flatten(1))\n"
        "def build():\n"
        "    return Fails()\n")
    return write_recipe(tmp_path / "r.yaml", raw)


def test_failing_stage_exits_1_with_one_line_and_marks_manifest(tmp_path: Path) -> None:
    path = _recipe_whose_training_raises(tmp_path, "RuntimeError('cannot train this one')")
    result = run_cli("run", str(path), env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1
    assert "stage finetune failed: RuntimeError: cannot train this one" in error_lines[0]
    stage = _manifest(tmp_path / "runs/tiny_digits")["stages"][0]
    assert stage["status"] == "failed" and "cannot train this one" in stage["error"]
    assert "RuntimeError" in (tmp_path / "runs/tiny_digits/00-finetune/error.log").read_text()


def test_a_stop_landing_while_a_failure_is_recorded_waits_until_it_is(tmp_path: Path) -> None:
    # torchrun's SIGTERM reaches rank 0 just after a dead rank's collective error: the
    # error's text (read while the failure is written) sends it here
    path = _recipe_whose_training_raises(tmp_path, "RankDied()", prelude=(
        "import os, signal, time\n"
        "class RankDied(RuntimeError):\n"
        "    sent = False\n"
        "    def __str__(self):\n"
        "        if not RankDied.sent:\n"
        "            RankDied.sent = True; os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
        "        return 'connection closed by peer'\n"))
    result = run_cli("run", str(path), env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == -15, result.stderr[-2000:]  # the stop still stops it
    stage = _manifest(tmp_path / "runs/tiny_digits")["stages"][0]
    assert stage["status"] == "failed" and "connection closed by peer" in stage["error"]
    assert "RankDied" in (tmp_path / "runs/tiny_digits/00-finetune/error.log").read_text()


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "00-finetune/model/model.safetensors"))


def test_kill_9_mid_training_then_rerun_resumes_to_the_same_weights(tmp_path: Path) -> None:
    long_run = {"epochs": 40, "checkpoint_every": 20}
    ref = write_recipe(tmp_path / "ref.yaml", digits_recipe(tmp_path / "ref", **long_run))
    assert run_cli("run", str(ref)).returncode == 0

    path = write_recipe(tmp_path / "r.yaml", digits_recipe(tmp_path / "runs", **long_run))
    run_dir = tmp_path / "runs" / "tiny_digits"
    checkpoint = run_dir / "00-finetune/checkpoints/checkpoint.pt"
    start_and_kill(path, checkpoint.exists)
    manifest = _manifest(run_dir)
    assert manifest["stages"][0]["status"] == "running"  # consistent, and honest about it

    result = run_cli("run", str(path))
    assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stderr
    stage = _manifest(run_dir)["stages"][0]
    assert stage["status"] == "done" and stage["metrics"]["resumed_from_step"] > 0
    reference = _final_weights(tmp_path / "ref" / "tiny_digits")
    resumed = _final_weights(run_dir)
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), name


def test_a_changed_stage_module_runs_the_stage_again(tmp_path: Path, monkeypatch) -> None:
    copy = tmp_path / "code" / "compress"  # the sources the keys read, to edit safely
    shutil.copytree(code_digest.module_file("compress").parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    real = code_digest._package_dir
    monkeypatch.setattr(code_digest, "_package_dir",
                        lambda name: copy if name == "compress" else real(name))
    raw = digits_recipe(tmp_path / "runs", epochs=1)
    raw["stages"].append({"kind": "prune", "amount": 0.3})
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", raw))
    run_dir = run_recipe(recipe, echo=lambda _: None)
    assert _stage_statuses(run_dir) == ["done", "done"]
    assert _stage_statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "cached"]

    assert (copy / "cli" / "main.py").is_file() and (copy / "stages" / "prune.py").is_file()
    with open(copy / "cli" / "main.py", "a") as out:  # not reachable from either stage
        out.write("\n# a comment\n")
    assert _stage_statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "cached"]
    with open(copy / "stages" / "prune.py", "a") as out:  # the prune stage's module
        out.write("\n# a comment\n")
    assert _stage_statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "done"]
