"""Expert-parallel inference of a mixture-of-experts causal-LM folder across the ranks of a
torchrun job, with torch.distributed alone and no compress code (shipped in a causal-LM
export's `causal_lm` package).

Each of N ranks keeps a contiguous block of 1/N of every layer's experts; the routers,
attention, norms, embeddings and head stay whole on every rank, which all decode the same
rows in step. Tokens reach their experts' ranks by `all_to_all_single` and come back the
same way (`expert_dispatch.py` says which rank routes which token). Served
(`parallelType: pp` in TorchServe's terms: rank 0 alone gets the requests), rank 0 leads
every generation: `LeadingDecoder` broadcasts its arguments (as tensors: `leader_call.py`)
and the rows its streams end, and the other ranks `follow`.

    cd FOLDER && torchrun --nproc-per-node 2 -m causal_lm.expert_parallel . \
        --prompts prompts.txt --out ep.json

prints (and writes to --out, from rank 0) the largest logit difference against the same model
in one process, greedy agreement, the expert weight bytes each rank holds, decode tokens/s
at batch 8 with 1 and N ranks, and the share of a decode step spent in all-to-all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: checking a config needs none
    from torch import nn

    from .leader_call import LeaderCall

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def split_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why `ranks` cannot split the experts of a model of this config (config.json's keys)
    into equal blocks (None when they can). Imports no torch."""
    experts = next((config[k] for k in EXPERT_KEYS if config.get(k)), None)
    if not experts:
        return (f"expert_parallel: the model ({config.get('model_type', '?')}) has no "
                "mixture-of-experts layers to split; drop expert_parallel, or use "
                "tensor_parallel or pipeline_parallel")
    if experts % ranks:
        return (f"expert_parallel: {ranks} does not divide the model's {experts} experts "
                f"per layer; use a divisor of {experts}")
    return None


def join_and_split(model: nn.Module, folder: Path) -> int:
    """In a rank of a torchrun job (TorchServe's torchrun workers, or any other): join the
    process group (`process_group.join`: on one machine through a FileStore in `folder`, on
    loopback) and keep this rank's experts; the rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from . import process_group
    from .expert_dispatch import shard_experts

    process_group.join(folder, timeout=timedelta(days=365))  # a follower waits as long as
    # the server idles

    shard_experts(model, dist.get_rank(), dist.get_world_size())
    return dist.get_rank()


class LeadingDecoder:
    """A decoder (`StaticDecoder`) run in step on every rank: rank 0's arguments (its
    sampling seeds drawn there; sent as tensors, `leader_call.py`) and the rows its
    `on_tokens` ends are broadcast to all."""

    def __init__(self, decoder: Any):
        self.decoder = decoder
        self.compiled = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["decoder"], name)

    def generate(self, prompt: Any, max_new_tokens: Any, stop: set[int] | None = None,
                 sampling: Any = None, on_tokens: Any = None) -> Any:
        """`StaticDecoder.generate` with rank 0's arguments on every rank."""
        import dataclasses
        import random

        import torch.distributed as dist

        from . import leader_call

        if dist.get_rank() == 0 and sampling:  # every rank samples with rank 0's seeds
            sampling = [dataclasses.replace(p, seed=random.randrange(2**31))
                        if p is not None and p.seed is None and p.temperature > 0 else p
                        for p in sampling]
        call = leader_call.LeaderCall.of(prompt, max_new_tokens, stop, sampling)
        return self.run(leader_call.broadcast(call), on_tokens)

    def run(self, call: LeaderCall, on_tokens: Any = None) -> Any:
        """Decode the generation rank 0 announced; the rows rank 0's `on_tokens` ends, end
        on every rank."""
        import torch
        import torch.distributed as dist

        lead = dist.get_rank() == 0

        def ended(produced: list[int | None]) -> list[int]:
            flags = torch.zeros(len(call.prompt), dtype=torch.uint8)
            if lead and on_tokens is not None:
                flags[list(on_tokens(produced) or ())] = 1
            dist.broadcast(flags, src=0)
            return flags.nonzero().flatten().tolist()

        return self.decoder.generate(call.prompt, call.max_new_tokens, call.stop,
                                     call.sampling, ended)


def leading_decoders(model: nn.Module, cache_len: int) -> Any:
    """A maker of leading decoders (a served worker's, one a bucket): each a masked
    `StaticDecoder` of `cache_len` positions."""
    from .decode import StaticDecoder

    return lambda: LeadingDecoder(StaticDecoder(model, cache_len, always_mask=True))


def follow(decoders: dict[int, LeadingDecoder]) -> Any:
    """On a rank other than 0 of a served expert-parallel worker: a daemon thread that runs
    every generation rank 0's decoders announce, each through the decoder of its rows."""
    from . import leader_call
    from .pipeline import follow_leader

    def step() -> None:
        call = leader_call.broadcast(None)
        rows = len(call.prompt)
        (decoders.get(rows) or decoders[max(decoders)]).run(call)

    return follow_leader(step, "expert-parallel")


def main(argv: list[str] | None = None) -> None:
    """Compare the expert-parallel model with one process (run under torchrun)."""
    from . import expert_compare, tensor_parallel

    tensor_parallel.run_comparison(expert_compare.compare, "causal_lm.expert_parallel", argv)


if __name__ == "__main__":
    main()

