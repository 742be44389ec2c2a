"""Expert-parallel export of a mixture-of-experts causal LM: torchrun gives each of 2
processes (gloo) half of every layer's experts of a tiny random Mixtral-style model, tokens
go to them and back with all_to_all_single, and its logits, tokens, per-rank expert bytes
and all-to-all telemetry are checked against one process; so are int8 and int4 grouped
experts (experts.GroupedExperts); impossible splits are one validation line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, write_recipe
from moe_models import tiny_moe_folder

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory) -> Path:
    return tiny_moe_folder("mixtral", tmp_path_factory.mktemp("tiny_mixtral"))


def _recipe(tmp_path: Path, model: Path, export: dict, stages: list[dict] | None = None,
            after: list[dict] | None = None) -> Path:
    raw = {"name": "ep", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 4}},
           "evaluation": {"generation": {"prompts": 2, "max_new_tokens": 6,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [*(stages or []), {"kind": "export", "format": "transformers", **export},
                      *(after or [])],
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
    assert (folder / "causal_lm/runtime/expert_parallel.py").is_file()


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
    dense = run_cli("validate", str(_recipe(
        tmp_path, varied_llama_folder, {"expert_parallel": 2},
        after=[{"kind": "package", "expert_parallel": ranks, "pipeline_parallel": 2}])))
    assert dense.returncode == 2
    assert "stages.0.expert_parallel: the model (llama) has no mixture-of-experts layers" \
        in dense.stderr
    assert "stages.1.expert_parallel: pipeline_parallel is set too" in dense.stderr
    assert f"stages.1.expert_parallel: {ranks} processes is more than" in dense.stderr


GROUPED = """
import copy, json
import torch, torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM
from serve.causal_lm.runtime import expert_dispatch
from serve.causal_lm.runtime import experts

dist.init_process_group("gloo")
rank, ranks = dist.get_rank(), dist.get_world_size()
config = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1)
out = {}
for bits in (8, 4):
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    experts.quantize_experts(model, bits)
    whole = copy.deepcopy(model)
    held = expert_dispatch.expert_weight_bytes(model)
    expert_dispatch.shard_experts(model, rank, ranks)
    ids = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(1))
    expert_dispatch.COMM.take()
    with torch.inference_mode():
        diff = max(float((model(input_ids=x).logits - whole(input_ids=x).logits).abs().max())
                   for x in (ids, ids[:1, :1]))  # a batch of prompts, and one token
    out[bits] = {"diff": diff, "whole": held, "mine": expert_dispatch.expert_weight_bytes(model),
                 "all_to_all": expert_dispatch.COMM.take()["all_to_all"]["calls"]}
got = [None] * ranks
dist.all_gather_object(got, out)
if rank == 0:
    print("RESULT " + json.dumps(got))
dist.destroy_process_group()
"""


def test_grouped_int8_and_int4_experts_split_over_two_ranks_exactly(tmp_path: Path) -> None:
    script = tmp_path / "grouped_ep.py"
    script.write_text(GROUPED)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    for rank in json.loads(line[len("RESULT "):]):
        for bits in ("8", "4"):
            got = rank[bits]
            assert got["diff"] <= 1e-5  # the same grouped kernel on the same rows
            assert 2 * got["mine"] == got["whole"]
            assert got["all_to_all"] == 2 * 3 * 2  # 2 forwards x 2 layers x 3
