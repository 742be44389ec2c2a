"""Data-parallel runs under torchrun: the process group, rank checks and small collectives.

`compress run RECIPE --nproc N` re-executes itself through `torchrun`; every process runs
the same recipe. Rank 0 owns the run folder (manifest, evaluation, artifacts, reports);
training stages (finetune, distill) run on every rank with DistributedDataParallel, and
the other ranks follow rank 0's decisions (which stage runs, from which model) through
`broadcast`. Outside torchrun every helper here is a no-op for a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

# Stage kinds whose training runs data-parallel; every other kind runs once, on rank 0.
PARALLEL_KINDS = frozenset({"finetune", "distill"})
TIMEOUT_MIN = int(os.environ.get("COMPRESS_DIST_TIMEOUT_MIN", "120"))


def world_size() -> int:
    """Processes in the job (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Whether this process owns the run folder."""
    return rank() == 0


_solo = False


def active() -> bool:
    """Whether a process group with more than one process is up (and this code is not
    inside `solo()`)."""
    if _solo:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def solo() -> Iterator[None]:
    """Run the block as a single process (a stage rank 0 runs alone: no DDP, no
    collectives), even inside a torchrun job."""
    global _solo
    before, _solo = _solo, True
    try:
        yield
    finally:
        _solo = before


def init() -> bool:
    """Join the torchrun job (gloo on CPU, NCCL on GPU); False for a single process.

    SIGTERM (what torchrun sends every rank when one dies) is turned into
    KeyboardInterrupt, so rank 0 marks its stage interrupted before it exits."""
    if world_size() <= 1:
        return False
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # comm.CommMeter reads it
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=TIMEOUT_MIN))
    signal.signal(signal.SIGTERM, _terminated)
    return True


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then act on them as before: a failure
    is recorded whole even when torchrun's stop lands while the dead rank's error is
    handled. (A handler swap, not a signal mask: the mask of one thread would leave the
    signal to the process's other threads, whose default action ends it at once.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers, and only it receives them
        return
    held: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {stop: signal.signal(stop, lambda signum, frame: held.append(signum))
              for stop in stops}
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def _terminated(signum, frame) -> None:
    print(f"rank {rank()}: stopped by SIGTERM (another rank failed or the job was "
          f"stopped)", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


def shutdown() -> None:
    """Leave the process group together: a barrier first, so no rank tears its
    connections down while another still reads from them (gloo aborts the process then).
    Safe to call when no group is up."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (a picklable value)."""
    if not active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sync_buffers(model) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank: DDP syncs them
    before each forward, so the last forward leaves them differing per rank."""
    if not active():
        return
    import torch.distributed as dist

    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)


def param_digest(model) -> str:
    """sha256 of every parameter and buffer, in order: equal on ranks in sync."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                          .numpy().tobytes())
    return digest.hexdigest()
