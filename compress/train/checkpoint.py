"""Checkpoints of the training loop: one file for a single process or DDP (rank 0 writes
it), or a sharded folder under FSDP (`compress.distributed.fsdp`). Either holds the model, the
optimizer, the scheduler, the step and every rank's random state, so a resumed run ends with
the weights of an uninterrupted one."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from compress.distributed import fsdp, process_group

CHECKPOINT = "checkpoint.pt"


def say(message: str) -> None:
    """A progress message from rank 0 only."""
    if process_group.is_main():
        tqdm.write(message, file=sys.stderr)


class Checkpoints:
    """Where a training run saves and resumes: `folder/checkpoint.pt`, or `folder/sharded/`
    when `is_sharded` (any process count). Every rank calls `save` and `resume`."""

    def __init__(self, folder: Path, key: str, world: int, is_sharded: bool = False):
        self.folder, self.key, self.world, self.is_sharded = folder, key, world, is_sharded

    def save(self, step: int, model: nn.Module, optimizer: Any, scheduler: Any) -> Path:
        """Write everything needed to continue after `step`."""
        if self.is_sharded:
            return fsdp.save(self.folder, self.key, step, model, optimizer, scheduler,
                                self.world)
        rngs = process_group.gather(torch.get_rng_state())
        if process_group.is_main():
            save_checkpoint(self.folder, self.key, step, model, optimizer, scheduler,
                            self.world, rngs)
        return self.folder / CHECKPOINT

    def resume(self, model: nn.Module, optimizer: Any, scheduler: Any) -> int:
        """Load the checkpoint of this run's key, if any; the step to go on from."""
        if self.is_sharded:
            return fsdp.resume(self.folder, self.key, model, optimizer, scheduler,
                                  self.world, say)
        return _resume(self.folder, self.key, model, optimizer, scheduler, self.world)


def save_checkpoint(folder: Path, key: str, step: int, model: nn.Module, optimizer,
                    scheduler, world: int = 1, rngs: list[torch.Tensor] | None = None) -> Path:
    """Atomically write everything needed to continue after `step` (and the number of
    processes that trained, so a resume with another number is reported)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {"key": key, "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": torch.get_rng_state(), "rngs": rngs or [torch.get_rng_state()],
             "world_size": world}
    tmp = folder / f".{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / CHECKPOINT)
    return folder / CHECKPOINT


def _resume(folder: Path, key: str, model: nn.Module, optimizer, scheduler,
            world: int = 1) -> int:
    path = folder / CHECKPOINT
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("key") != key:
        say(f"ignoring {path}: it belongs to another configuration")
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    saved = int(state.get("world_size", 1))
    rngs = state.get("rngs") or [state["rng"]]
    if saved == world and len(rngs) == world:
        torch.set_rng_state(rngs[process_group.rank() if world > 1 else 0])
    if saved != world:
        say(f"{path} was written by {saved} process(es) and resumes with {world}: from step "
            f"{state['step']} on, the data order and the steps per epoch follow {world}, so "
            f"the weights will not match an uninterrupted {saved}-process run")
    say(f"resuming from {path} at step {state['step']}")
    return int(state["step"])
