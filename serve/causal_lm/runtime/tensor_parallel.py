"""Tensor-parallel inference of a causal-LM folder across the ranks of a torchrun job, with
torch's DTensor engine (`torch.distributed.tensor.parallel`) and no compress code
(shipped in a causal-LM export's `causal_lm` package).

Every decoder layer is split by `parallelize_module`: the query, key, value, gate and up
projections column-wise (each rank computes its own heads, whole key-value groups, and its
share of the feed-forward neurons), the output and down projections row-wise (the partial
sums are all-reduced). Embeddings, norms and the output head stay whole on every rank.

    cd FOLDER && torchrun --nproc-per-node 2 -m causal_lm.tensor_parallel . \
        --prompts prompts.txt --out tp.json

prints (and writes to --out, from rank 0) the largest logit difference against the same model
in one process, the bytes of linear weights each rank holds, and greedy tokens and decode
tokens/s of both.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: checking a config needs none
    import torch
    from torch import nn

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _loading() -> Any:
    from . import loading

    return loading


def split_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why `ranks` cannot split a model of this config (config.json's keys) across its
    layers (None when it can): the key-value heads (and so the query heads, by whole groups)
    and the feed-forward neurons must divide. Imports no torch."""
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    if kv_heads % ranks:
        return (f"tensor_parallel: {ranks} does not divide the model's {kv_heads} key-value "
                f"heads (heads are split by whole key-value groups); use a divisor of "
                f"{kv_heads}")
    if config["intermediate_size"] % ranks:
        return (f"tensor_parallel: {ranks} does not divide the model's "
                f"{config['intermediate_size']} feed-forward neurons")
    return None


def shard_layers(model: nn.Module, mesh: Any) -> nn.Module:
    """Split every decoder layer's projections across `mesh` in place (see the module doc)."""
    from torch import nn
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    problem = split_problem(model.config.to_dict(), mesh.size())
    if problem:
        raise ValueError(problem)
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in COLUMN:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in ROW:
            plan[name] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def join_and_split(model: nn.Module, folder: Path) -> nn.Module:
    """In a rank of a torchrun job (TorchServe's `parallelType: tp` workers, or any other):
    join the process group (`process_group.join`: on one machine through a FileStore in
    `folder`, on loopback) and split `model` across it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from . import process_group

    process_group.join(folder)
    return shard_layers(model, init_device_mesh("cpu", (dist.get_world_size(),)))


def shared_seeds(seeds: list[int | None]) -> list[int | None]:
    """Rank 0's sampling seeds on every rank, a seed drawn there for each row without one:
    every rank must sample the same tokens, or their caches and collectives part ways. Sent
    as one int64 a row (every rank has the same rows), never a pickle."""
    import random

    import torch
    import torch.distributed as dist

    from .leader_call import seed_bits, seed_of

    drawn = [s if s is not None else random.randrange(2**31) for s in seeds]
    box = torch.tensor([seed_bits(s) for s in drawn], dtype=torch.int64)
    dist.broadcast(box, src=0)
    return [seed_of(s) for s in box.tolist()]


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' projection weights this rank holds (its shards)."""
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in COLUMN + ROW:
            weight = module.weight
            local = getattr(weight, "_local_tensor", weight)
            total += local.untyped_storage().nbytes()
    return total


def logits_of(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every position of one prompt (float32)."""
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def decode(model: nn.Module, prompts: list[list[int]], max_new_tokens: int
           ) -> tuple[list[list[int]], float]:
    """Greedy tokens of each prompt (batch 1, static cache) and the median decode tok/s."""
    decoder = _loading().StaticDecoder(model, max(len(p) for p in prompts) + max_new_tokens + 8)
    decoder.generate([prompts[0]], 2)  # warm-up
    tokens, rates = [], []
    for ids in prompts:
        out = decoder.generate([ids], max_new_tokens)
        tokens.append(out.tokens)
        rates.append(out.decode_tokens_per_s)
    return tokens, sorted(rates)[len(rates) // 2]


def compare(folder: str, prompts: list[Any], max_new_tokens: int,
            chat_template: bool = True) -> dict[str, Any]:
    """Run on every rank of a torchrun job: the tensor-parallel model against itself in one
    process (rank 0 keeps an unsplit copy)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    loading = _loading()
    ranks, rank = dist.get_world_size(), dist.get_rank()
    lm = loading.load_folder(folder)
    if lm.facts.get("scheme"):
        raise ValueError(f"{folder} holds a {lm.facts['scheme']} model: tensor parallelism "
                         "takes a float model (quantize after, or not at all)")
    ids = [loading.prompt_ids(lm.tokenizer, p, chat_template) for p in prompts]
    whole = copy.deepcopy(lm.model) if rank == 0 else None
    began = time.perf_counter()
    shard_layers(lm.model, init_device_mesh("cpu", (ranks,)))
    shard_s = time.perf_counter() - began
    split_logits = [logits_of(lm.model, i) for i in ids]
    split_tokens, split_rate = decode(lm.model, ids, max_new_tokens)
    held = [None] * ranks
    dist.all_gather_object(held, linear_weight_bytes(lm.model))
    if rank != 0:
        return {}
    assert whole is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # one process may use every core
    whole_logits = [logits_of(whole, i) for i in ids]
    whole_tokens, whole_rate = decode(whole, ids, max_new_tokens)
    diff = max(float((a - b).abs().max()) for a, b in zip(split_logits, whole_logits,
                                                          strict=True))
    same = sum(a == b for x, y in zip(split_tokens, whole_tokens, strict=True)
               for a, b in zip(x, y, strict=False))
    total = sum(min(len(x), len(y)) for x, y in zip(split_tokens, whole_tokens, strict=True))
    return {"tensor_parallel": ranks, "prompts": len(ids), "max_logit_diff": diff,
            "greedy_agreement": round(same / max(total, 1), 4),
            "linear_weight_bytes_per_rank": held,
            "linear_weight_bytes_one_process": linear_weight_bytes(whole),
            "decode_tok_s_b1": round(split_rate, 2),
            "decode_tok_s_b1_one_process": round(whole_rate, 2),
            "threads_per_rank": threads, "threads_one_process": torch.get_num_threads(),
            "shard_s": round(shard_s, 3), "tokens": split_tokens}


def run_comparison(compare: Callable[[str, list[Any], int, bool], dict[str, Any] | None],
                   script: str, argv: list[str] | None = None) -> None:
    """The torchrun entry point of a comparison script (this file's, and
    pipeline_parallel.py's): read the arguments and prompts, run `compare(folder, prompts,
    max_new_tokens, chat_template)` on every rank, and write (--out) and print the figures it
    returns on rank 0 (printed without its token lists)."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=f"{script}: compare with one process")
    parser.add_argument("folder")
    parser.add_argument("--prompts", required=True, help="a text file, one prompt a line (or "
                        "a .json list of prompts and chat message lists)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="encode prompts as plain text")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error(f"run it under torchrun, in FOLDER: torchrun --nproc-per-node N -m "
                     f"{script} . --prompts FILE")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    text = Path(args.prompts).read_text()
    prompts = json.loads(text) if args.prompts.endswith(".json") else [
        line.strip() for line in text.splitlines() if line.strip()]
    try:
        figures = compare(args.folder, prompts, args.max_new_tokens,
                          not args.no_chat_template)
        if figures:
            if args.out:
                Path(args.out).write_text(json.dumps(figures))
            print(json.dumps({k: v for k, v in figures.items()
                              if not k.startswith("tokens")}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Compare the tensor-parallel model with one process (run under torchrun)."""
    run_comparison(compare, "causal_lm.tensor_parallel", argv)


if __name__ == "__main__":
    main()
