"""FSDP for the training loop (`parallel: fsdp`): `fully_shard` per transformer block and
then the root, and sharded checkpoints through `torch.distributed.checkpoint` (DCP).

A DCP checkpoint is a folder of shards plus `.metadata`; loading reshards it to however many
processes load it, so a run checkpointed by 2 processes resumes on 1, and the reverse. A
one-process `parallel: fsdp` run trains plainly but writes the same format. Beside the
shards, `meta.json` holds the cache key, the step, the process count and the scheduler, and
`rng.pt` every rank's random state; the folder is written under a temporary name and renamed
once every rank has finished writing, so a kill mid-save leaves the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

SHARDED = "sharded"  # the checkpoint folder's name inside the stage's checkpoint folder


def shard(model: nn.Module, blocks: list[nn.Module], bf16: bool = False) -> nn.Module:
    """`fully_shard` each block, then the root (which holds what no block does: embeddings,
    the head); with `bf16`, parameters are gathered and computed in bf16 and gradients
    reduced in fp32. Every rank starts from rank 0's weights."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model, gathered on every rank (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _barrier() -> None:
    from compress.distributed import process_group

    if process_group.active():
        import torch.distributed as dist

        dist.barrier()


def save(folder: Path, key: str, step: int, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any, world: int) -> Path:
    """Write a sharded checkpoint after `step` into `folder/sharded` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    from compress.distributed import process_group

    final, tmp = folder / SHARDED, folder / f".{SHARDED}.tmp"
    if process_group.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_states(model, optimizer), checkpoint_id=str(tmp))
    rngs = process_group.gather(torch.get_rng_state())
    if process_group.is_main():
        torch.save(rngs, tmp / "rng.pt")
        meta = {"key": key, "step": step, "world_size": world,
                "scheduler": scheduler.state_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier()
    return final


def resume(folder: Path, key: str, model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: Any, world: int, say: Any) -> int:
    """Load `folder/sharded` when it belongs to `key` (every rank calls it; any process
    count); the step it was written after, or 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from compress.distributed import process_group

    path = folder / SHARDED
    meta_file = path / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if meta is None or meta.get("key") != key:
        if meta is not None:
            say(f"ignoring {path}: it belongs to another configuration")
        return 0
    states = _states(model, optimizer)
    dcp.load(states, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=states["model"],
                   optim_state_dict=states["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    saved = int(meta["world_size"])
    if saved == world:
        rngs = torch.load(path / "rng.pt", weights_only=True)
        torch.set_rng_state(rngs[process_group.rank() if world > 1 else 0])
    else:
        say(f"{path} was written by {saved} process(es) and resumes on {world}: "
            f"resharded by torch.distributed.checkpoint; from step {meta['step']} on, each "
            f"step takes batch_size x {world} examples")
    say(f"resuming from {path} at step {meta['step']}")
    return int(meta["step"])
