"""Data-parallel runs under torchrun on this machine's CPU cores: replicas stay identical,
rank 0 alone writes the run folder and runs the other stages, a killed rank stops the job
with a consistent run folder, and its checkpoint resumes under DDP or on one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, digits_recipe, run_cli, start_and_kill, write_recipe

from compress.distributed.process_group import param_digest
from compress.models.folders import load_saved

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def test_two_ranks_train_identical_replicas_and_rank_0_runs_the_rest(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs", epochs=6)
    raw["stages"] += [{"kind": "prune", "method": "unstructured", "amount": 0.3,
                       "recovery": {"max_steps": 5, "batch_size": 32, "learning_rate": 0.001}},
                      {"kind": "export", "format": "onnx"}]
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("run folder:") == 1  # rank 1 prints nothing
    assert "launching 2 processes with torchrun" in result.stderr
    run_dir = tmp_path / "runs/tiny_digits"
    finetune, prune, export = _manifest(run_dir)["stages"]
    m = finetune["metrics"]
    assert m["train_processes"] == 2 and m["replicas_identical"] is True
    # 1437 train images, 719 per rank, 23 micro-batches of 32 per epoch and rank
    assert m["train_steps"] == 6 * 23 and m["accuracy"] >= 0.85, m
    saved = load_saved(run_dir / finetune["outputs"][0]["model_dir"])
    assert param_digest(saved.model) == m["param_digest"]  # rank 0 saved what both held
    assert prune["status"] == export["status"] == "done"
    assert "train_processes" not in prune["metrics"]  # its recovery ran on rank 0 alone
    assert export["metrics"]["parity_argmax_agreement"] == 1.0
    assert (run_dir / "report.json").is_file() and not list(run_dir.glob("*/checkpoints"))


def _long_recipe(tmp_path: Path) -> tuple[Path, Path]:
    # long enough that a rank is killed mid-run after the first checkpoint (step 20 of 540)
    raw = digits_recipe(tmp_path / "runs", epochs=12, checkpoint_every=20, batch_size=16)
    raw["model"] = {"source": "compress.models.zoo:small_cnn",
                    "kwargs": {"num_classes": 10, "channels": 32}}
    raw["stages"][0]["learning_rate"] = 0.003
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    return recipe, tmp_path / "runs/tiny_digits/00-finetune/checkpoints/checkpoint.pt"


def test_a_killed_rank_stops_the_job_and_a_rerun_resumes_under_ddp(tmp_path: Path) -> None:
    recipe, checkpoint = _long_recipe(tmp_path)
    stopped = start_and_kill(recipe, checkpoint.is_file, "--nproc", "2", rank=1)
    assert stopped.returncode != 0
    assert "rank 1 exited with -9" in stopped.stderr and "Traceback" not in stopped.stderr
    assert "re-run the same command to resume" in stopped.stderr
    run_dir = tmp_path / "runs/tiny_digits"
    stage = _manifest(run_dir)["stages"][0]  # the manifest is whole JSON
    assert stage["status"] == "failed" and stage["outputs"] == []
    assert checkpoint.is_file()
    assert not (run_dir / "00-finetune/model").exists()  # no half-written model
    again = run_cli("run", str(recipe), "--nproc", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    m = _manifest(run_dir)["stages"][0]["metrics"]
    assert m["resumed_from_step"] >= 20 and m["resumed_from_step"] % 20 == 0
    assert m["replicas_identical"] is True and m["accuracy"] >= 0.9


def test_a_ddp_checkpoint_resumes_on_one_process_and_says_so(tmp_path: Path) -> None:
    recipe, checkpoint = _long_recipe(tmp_path)
    assert start_and_kill(recipe, checkpoint.is_file, "--nproc", "2", rank=1).returncode != 0
    single = run_cli("run", str(recipe))
    assert single.returncode == 0, single.stderr[-3000:]
    assert "was written by 2 process(es) and resumes with 1" in single.stderr
    m = _manifest(tmp_path / "runs/tiny_digits")["stages"][0]["metrics"]
    assert m["train_processes"] == 1 and m["resumed_from_step"] >= 20


def test_max_restarts_restarts_a_killed_rank_and_ends_with_the_uninterrupted_weights(
        tmp_path: Path) -> None:
    recipe, checkpoint = _long_recipe(tmp_path)
    restarted = start_and_kill(recipe, checkpoint.is_file, "--nproc", "2", "--max-restarts", "1",
                               rank=1)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "restart 1: resuming the run" in restarted.stderr
    m = _manifest(tmp_path / "runs/tiny_digits")["stages"][0]["metrics"]
    assert m["resumed_from_step"] >= 20 and m["replicas_identical"] is True
    reference = run_cli("run", str(recipe), "--nproc", "2", "--output-dir",
                        str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    whole = _manifest(tmp_path / "reference/tiny_digits")["stages"][0]["metrics"]
    assert whole["resumed_from_step"] == 0
    assert m["param_digest"] == whole["param_digest"]  # the same final weights, bit for bit


def test_launch_options_are_checked(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", digits_recipe(tmp_path / "runs"))
    result = run_cli("run", str(recipe), "--nproc", "2", "--nnodes", "2")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --nnodes > 1 needs --master-addr (the address of node 0) and the same "
        "--master-port on every node")
    assert not (tmp_path / "runs").exists()
    cores = os.cpu_count() or 1
    crowded = run_cli("run", str(recipe), "--nproc", str(cores + 1))
    assert crowded.returncode == 2 and crowded.stderr.strip() == (
        f"error: --nproc {cores + 1} is more than the {cores} CPU cores of this machine: "
        f"processes would share them and each run slower; use --nproc {cores} or fewer, or "
        f"add --oversubscribe to run anyway")
    restarts = run_cli("run", str(recipe), "--max-restarts", "1")
    assert restarts.returncode == 2 and restarts.stderr.strip() == (
        "error: --max-restarts restarts torchrun's ranks: use it with --nproc N")
    assert not (tmp_path / "runs").exists()
    crowded = run_cli("run", str(recipe), "--nproc", str(cores + 1), "--oversubscribe")
    assert crowded.returncode == 0, crowded.stderr[-3000:]
    assert f"warning: --nproc {cores + 1} is more than the" in crowded.stderr


@pytest.mark.integration
def test_cnn_digits_recipe_on_two_processes_reaches_95_percent(tmp_path: Path) -> None:
    """The recipe's one full run in the suite (test_recipes_end_to_end ran it once more on
    one process; the README's example runs it on one process for 2 epochs)."""
    result = run_cli("run", str(REPO / "recipes/cnn_digits.yaml"), "--output-dir",
                     str(tmp_path), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = _manifest(tmp_path / "cnn_digits")
    m = manifest["stages"][0]["metrics"]
    assert manifest["data"]["eval"] == 360  # the stratified 20% holdout
    assert m["train_processes"] == 2 and m["replicas_identical"] is True
    assert m["accuracy"] >= 0.95 and m["macro_f1"] >= 0.95, m
