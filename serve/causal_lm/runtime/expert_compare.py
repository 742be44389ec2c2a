"""The expert-parallel model against the same model in one process, on every rank of a
torchrun job (`python -m causal_lm.expert_parallel`; shipped in the `causal_lm` package,
no compress code): logits, greedy tokens, expert weight bytes per rank, decode tokens/s at
batch 8, and the all-to-all time and bytes of a decode step."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import decode, expert_dispatch, loading

BATCH = 8


def logits_of(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every position of one prompt (float32)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def timed_batch(decoder: Any, prompts: list[list[int]], max_new_tokens: int
                ) -> dict[str, Any]:
    """One generation of `prompts` (every row to `max_new_tokens`), its decode steps timed
    from the first token on: tok/s, and the collectives of those steps per step."""
    marks: list[float] = []

    def on_tokens(produced: list[int | None]) -> list[int]:
        if not marks:
            expert_dispatch.COMM.take()  # the prefill's collectives are not a decode step's
        marks.append(time.perf_counter())
        return []

    expert_dispatch.COMM.take()
    out = decoder.generate(prompts, max_new_tokens, None, None, on_tokens)
    comm = expert_dispatch.COMM.take()
    steps = max(len(marks) - 1, 1)
    spent = max(marks[-1] - marks[0], 1e-9)
    later = sum(max(len(r) - 1, 0) for r in out.rows)
    return {"tok_s": later / spent, "step_s": spent / steps, "rows": out.rows,
            "comm": {k: {"s_per_step": round(v["s"] / steps, 6),
                         "bytes_per_step": round(v["bytes"] / steps),
                         "calls_per_step": round(v["calls"] / steps, 2)}
                     for k, v in comm.items()}}


def _agreement(split: list[list[int]], whole: list[list[int]]) -> float:
    pairs = [(a, b) for x, y in zip(split, whole, strict=True)
             for a, b in zip(x, y, strict=False)]
    return round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4)


def compare(folder: str, prompts: list[Any], max_new_tokens: int,
            chat_template: bool = True) -> dict[str, Any]:
    """Run on every rank of a torchrun job: the expert-parallel model against itself in one
    process (rank 0 keeps an unsplit copy); the figures on rank 0."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    lm = loading.load_folder(folder)
    ids = [loading.prompt_ids(lm.tokenizer, p, chat_template) for p in prompts]
    whole = copy.deepcopy(lm.model) if rank == 0 else None
    whole_bytes = expert_dispatch.expert_weight_bytes(lm.model)
    began = time.perf_counter()
    expert_dispatch.shard_experts(lm.model, rank, ranks)
    shard_s = time.perf_counter() - began
    split_logits = [logits_of(lm.model, i) for i in ids]
    cache = max(len(i) for i in ids) + max_new_tokens + 8
    decoder = decode.StaticDecoder(lm.model, cache)
    split_tokens = [decoder.generate([i], max_new_tokens).tokens for i in ids]
    batch = (ids * BATCH)[:BATCH]
    batched = decode.StaticDecoder(lm.model, cache)
    batched.generate(batch, 2)  # warm-up
    split = timed_batch(batched, batch, max_new_tokens)
    held = [None] * ranks
    dist.all_gather_object(held, expert_dispatch.expert_weight_bytes(lm.model))
    steps = [None] * ranks
    dist.all_gather_object(steps, split["comm"])
    if whole is None:
        return {}
    threads = torch.get_num_threads()  # the reference at a rank's threads: a GEMM split
    whole_logits = [logits_of(whole, i) for i in ids]  # over more threads rounds otherwise
    one = decode.StaticDecoder(whole, cache)
    whole_tokens = [one.generate([i], max_new_tokens).tokens for i in ids]
    one_batched = decode.StaticDecoder(whole, cache)
    one_batched.generate(batch, 2)  # warm-up
    alone_as_rank = timed_batch(one_batched, batch, max_new_tokens)
    torch.set_num_threads(os.cpu_count() or 1)  # and timed on every core
    alone = timed_batch(one_batched, batch, max_new_tokens)
    diff = max(float((a - b).abs().max()) for a, b in zip(split_logits, whole_logits,
                                                          strict=True))
    a2a = [s.get("all_to_all", {}) for s in steps]
    a2a_s = max(s.get("s_per_step", 0.0) for s in a2a)
    return {"expert_parallel": ranks, "prompts": len(ids), "max_logit_diff": diff,
            "greedy_agreement": _agreement(split_tokens + split["rows"],
                                           whole_tokens + alone_as_rank["rows"]),
            "expert_weight_bytes_per_rank": held,
            "expert_weight_bytes_one_process": whole_bytes,
            "decode_tok_s_b8": round(split["tok_s"], 2),
            "decode_tok_s_b8_one_process": round(alone["tok_s"], 2),
            "decode_tok_s_b8_one_process_rank_threads": round(alone_as_rank["tok_s"], 2),
            "decode_step_ms_b8": round(split["step_s"] * 1e3, 3),
            "all_to_all_ms_per_step": round(a2a_s * 1e3, 3),
            "all_to_all_bytes_per_step": [s.get("bytes_per_step", 0) for s in a2a],
            "all_to_all_share": round(min(1.0, a2a_s / max(split["step_s"], 1e-9)), 4),
            "comm_per_step": steps,
            "threads_per_rank": threads, "threads_one_process": os.cpu_count() or 1,
            "shard_s": round(shard_s, 3), "tokens": split_tokens,
            "tokens_one_process": whole_tokens}
