"""Expert-parallel export of a mixture-of-experts causal LM: torchrun gives each of 2
processes (gloo) half of every layer's experts of a tiny random Mixtral-style model, tokens
go to them and back with all_to_all_single, and its logits, tokens, per-rank expert bytes
and all-to-all telemetry are checked against one process; impossible splits are one
validation line each."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli, write_recipe
from expert_parallel_models import tiny_mixtral_folder

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory) -> Path:
    return tiny_mixtral_folder(tmp_path_factory.mktemp("tiny_mixtral"))


def _recipe(tmp_path: Path, model: Path, export: dict, stages: list[dict] | None = None
            ) -> Path:
    raw = {"name": "ep", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 12}},
           "evaluation": {"generation": {"prompts": 3, "max_new_tokens": 6,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [*(stages or []), {"kind": "export", "format": "transformers", **export}],
           "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "ep.yaml", raw)


def test_two_ranks_give_the_one_process_logits_with_half_the_experts_each(
        tmp_path: Path, mixtral_folder: Path) -> None:
    done = run_cli("run", str(_recipe(tmp_path, mixtral_folder, {"expert_parallel": 2})))
    assert done.returncode == 0, done.stderr[-3000:]
    stage = json.loads((tmp_path / "runs/ep/manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert m["ep_processes"] == 2 and m["ep_max_logit_diff"] <= 1e-5
    assert m["ep_greedy_agreement"] == 1.0
    assert m["ep_expert_weight_share"] == 0.5  # measured storage bytes on each rank
    mb = m["ep_expert_weight_mb_per_rank"]
    assert len(mb) == 2 and mb[0] == mb[1]
    assert m["ep_decode_tok_s_b8"] > 0 and m["ep_decode_tok_s_b8_one_process"] > 0
    # the communication telemetry: every decode step sends its tokens to the experts
    assert m["ep_comm_all_to_all_s_per_step"] > 0 and 0 < m["ep_comm_share"] <= 1
    assert all(b > 0 for b in m["ep_comm_mb_per_step"])
    figures = json.loads((tmp_path / "runs/ep/00-export/expert_parallel.json").read_text())
    held = figures["expert_weight_bytes_per_rank"]
    assert held[0] == held[1] and 2 * held[0] == figures["expert_weight_bytes_one_process"]
    for rank in figures["comm_per_step"]:  # per decode step: counts, tokens out and back
        assert rank["all_to_all"]["calls_per_step"] == 3 * 2  # 3 a layer, 2 layers
        assert rank["all_to_all"]["bytes_per_step"] > 0
    folder = tmp_path / "runs/ep" / stage["outputs"][0]["export_dir"]
    assert (folder / "causal_lm/expert_parallel.py").is_file()


def test_splits_that_cannot_work_are_one_line_each(tmp_path: Path, mixtral_folder: Path,
                                                   varied_llama_folder: Path) -> None:
    cores = os.cpu_count() or 1
    ranks = 3 if cores < 3 else cores + 1  # 4 experts: 3 never divides them
    ranks += ranks % 4 == 0
    bad = run_cli("validate", str(_recipe(tmp_path, mixtral_folder,
                                          {"expert_parallel": ranks, "tensor_parallel": 2})))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert f"stages.0.expert_parallel: {ranks} does not divide the model's 4 experts per " \
           "layer" in bad.stderr
    assert "stages.0.expert_parallel: tensor_parallel is set too" in bad.stderr
    assert f"stages.0.expert_parallel: {ranks} processes is more than the {cores} CPU " \
           "cores" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert all(line.startswith(("error:", "  ", "stages.")) or "ep.yaml" in line
               for line in lines), lines
    over = run_cli("validate", str(_recipe(tmp_path, mixtral_folder,
                                           {"expert_parallel": 4, "oversubscribe": True})))
    assert over.returncode == 0, over.stderr  # 4 divides 4 experts; more ranks than cores
    dense = run_cli("validate", str(_recipe(tmp_path, varied_llama_folder,
                                            {"expert_parallel": 2})))
    assert dense.returncode == 2
    assert "stages.0.expert_parallel: the model (llama) has no mixture-of-experts layers" \
        in dense.stderr
