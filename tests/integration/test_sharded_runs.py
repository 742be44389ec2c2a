"""FSDP training under torchrun on this machine's 2 cores (gloo), on a tiny random Llama:
2 ranks at batch B train what 1 process trains at batch 2B with half the parameter and
optimizer bytes per rank, and a killed run resumes from its sharded checkpoint on 2
processes (to the weights of a run never stopped), on 1, and from 1 process on 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli, start_and_kill, write_recipe

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def _recipe(tmp_path: Path, model: Path, name: str, **stage) -> Path:
    finetune = {"kind": "finetune", "parallel": "fsdp", "max_steps": 8, "batch_size": 4,
                "learning_rate": 0.001, "checkpoint_every": 3, **stage}
    raw = {"name": name, "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "train": {"split": "train", "max_samples": 400},
                    "eval": {"split": "validation", "max_samples": 12}},
           "evaluation": {"generation": {"prompts": 2, "max_new_tokens": 4,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [finetune], "output_dir": str(tmp_path / "runs"), "seed": 0}
    return write_recipe(tmp_path / f"{name}.yaml", raw)


def _metrics(tmp_path: Path, name: str) -> dict:
    manifest = json.loads((tmp_path / "runs" / name / "manifest.json").read_text())
    return manifest["stages"][0]["metrics"]


def test_fsdp_on_two_ranks_trains_like_one_process_with_half_the_state_per_rank(
        tmp_path: Path, tiny_llama_folder: Path) -> None:
    two = run_cli("run", str(_recipe(tmp_path, tiny_llama_folder, "two")), "--nproc", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("run", str(_recipe(tmp_path, tiny_llama_folder, "one", batch_size=8)))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "parallel: fsdp with one process trains unsharded" in one.stderr
    m2, m1 = _metrics(tmp_path, "two"), _metrics(tmp_path, "one")
    assert m2["train_processes"] == 2 and m2["replicas_identical"] is True
    # the same examples in every optimizer step: the losses agree to rounding
    assert abs(m2["train_loss"] - m1["train_loss"]) <= 1e-4 * m1["train_loss"], (m1, m2)
    assert abs(m2["perplexity"] - m1["perplexity"]) <= 1e-4 * m1["perplexity"]
    # measured bytes of parameters + AdamW state held per process
    assert m2["train_state_mb_per_rank"] <= 0.6 * m1["train_state_mb_per_rank"], (m1, m2)
    assert m2["train_optimizer_state_mb_per_rank"] > 0
    assert m2["train_grad_norm_final"] > 0 and m2["train_step_s_median"] > 0


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 2)])
def test_a_killed_fsdp_run_resumes_from_its_sharded_checkpoint(
        tmp_path: Path, tiny_llama_folder: Path, before: int, after: int) -> None:
    name = f"from{before}to{after}"
    recipe = _recipe(tmp_path, tiny_llama_folder, name, max_steps=80, checkpoint_every=10)
    checkpoint = tmp_path / "runs" / name / "00-finetune/checkpoints/sharded/meta.json"
    if before == 2:
        assert start_and_kill(recipe, checkpoint.is_file, "--nproc", "2", rank=1).returncode != 0
    else:
        start_and_kill(recipe, checkpoint.is_file)
    step = json.loads(checkpoint.read_text())["step"]
    assert 10 <= step < 80 and step % 10 == 0
    again = run_cli("run", str(recipe), *(["--nproc", "2"] if after == 2 else []))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    if before != after:
        assert f"was written by {before} process(es) and resumes on {after}" in again.stderr
    m = _metrics(tmp_path, name)
    assert m["resumed_from_step"] >= step and m["train_steps"] == 80
    assert m["train_processes"] == after
    if before == after:  # the same job resumed: the weights of a run never stopped
        whole = run_cli("run", str(_recipe(tmp_path, tiny_llama_folder, "whole", max_steps=80,
                                           checkpoint_every=10)), "--nproc", str(after))
        assert whole.returncode == 0, whole.stderr[-3000:]
        assert _metrics(tmp_path, "whole")["resumed_from_step"] == 0
        resumed, uninterrupted = (_weights(tmp_path, n) for n in (name, "whole"))
        assert len(uninterrupted) > 10 and resumed.keys() == uninterrupted.keys()
        start = _weights_of(tiny_llama_folder)
        assert any(not torch.equal(v, start.get(k, v))
                   for k, v in uninterrupted.items())  # training moved them
        for key, value in uninterrupted.items():
            torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=1e-5, msg=key)


def _weights(tmp_path: Path, name: str) -> dict:
    """The final state dict a run's fine-tune stage saved."""
    return _weights_of(tmp_path / "runs" / name / "00-finetune" / "model")


def _weights_of(folder: Path) -> dict:
    """The tensors of a model folder's safetensors files."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_distill_shards_the_student_with_bf16_and_activation_checkpointing(
        tmp_path: Path, tiny_llama_folder: Path) -> None:
    raw = yaml.safe_load(_recipe(tmp_path, tiny_llama_folder, "kd").read_text())
    raw["stages"] = [{"kind": "distill", "student": {"layers": 1}, "parallel": "fsdp",
                      "mixed_precision": "bf16", "activation_checkpointing": True,
                      "max_steps": 6, "batch_size": 4, "checkpoint_every": 3}]
    done = run_cli("run", str(write_recipe(tmp_path / "kd.yaml", raw)), "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    m = _metrics(tmp_path, "kd")
    assert m["train_processes"] == 2 and m["replicas_identical"] is True
    assert m["train_steps"] == 6 and m["train_optimizer_state_mb_per_rank"] > 0
