"""Sampling on a tensor-parallel causal LM (serve/causal_lm/runtime/tensor_parallel.py), two gloo
ranks spawned here (no torchrun, no server): `shared_seeds` gives every rank rank 0's seeds, a seed
drawn there for each row without one, so the ranks sample the same tokens, as the served
handler's batch path needs (each rank feeds its own token back into the collectives); and
they are samples, not the greedy tokens."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

PROMPTS = [[101, 2023, 2143, 2001], [101, 7592, 2045]]
NEW = 8


def _rank(rank: int, port: int, folder: str, out: str, share: bool) -> None:
    """One rank: split the model, sample both rows with (shared) seeds, write its tokens."""
    import random

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from serve.causal_lm.runtime import tensor_parallel
    from serve.causal_lm.runtime.decode import Sampling, StaticDecoder

    torch.set_num_threads(1)
    random.seed(rank)  # each rank would draw its own seeds
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = LlamaForCausalLM.from_pretrained(folder).eval()
        tensor_parallel.shard_layers(model, init_device_mesh("cpu", (2,)))
        seeds = [None, 11]  # the first row sends no seed
        seeds = tensor_parallel.shared_seeds(seeds) if share else [
            s if s is not None else random.randrange(2**31) for s in seeds]
        decoder = StaticDecoder(model, 32)
        sampled = decoder.generate(PROMPTS, NEW, sampling=[Sampling(0.9, 1.0, s)
                                                           for s in seeds]).rows
        greedy = decoder.generate(PROMPTS, NEW).rows
        Path(out, f"{rank}.json").write_text(json.dumps(
            {"seeds": seeds, "sampled": sampled, "greedy": greedy}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ranks_sample(folder: Path, out: Path, share: bool = True) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, str(folder), str(out), share), nprocs=2)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_tensor_parallel_ranks_sample_the_same_tokens_with_shared_seeds(
        varied_llama_folder: Path, tmp_path: Path) -> None:
    first, second = ranks_sample(varied_llama_folder, tmp_path)
    assert first["seeds"] == second["seeds"] and first["seeds"][1] == 11
    assert first["sampled"] == second["sampled"]
    assert first["greedy"] == second["greedy"]
    assert all(len(row) == NEW for row in first["sampled"])
    for sampled, greedy in zip(first["sampled"], first["greedy"], strict=True):
        assert sampled != greedy  # sampling happened, on every row
