"""The process group of a split model's ranks (tensor, pipeline or expert parallel), joined
so that on one machine nothing listens beyond loopback.

torchrun's usual way in, `init_process_group` with `env://`, has rank 0 host a `TCPStore`
at MASTER_ADDR:MASTER_PORT, and torch's TCPStore listens on every interface whatever
address it is given (`[::]`, both its libuv and its legacy server: pytorch/pytorch#173909);
gloo listens on the address the machine's hostname resolves to. So where every rank runs
on this machine (torchrun's WORLD_SIZE equals its LOCAL_WORLD_SIZE) the ranks meet in a
`FileStore` in `folder` (a served worker's model folder) instead, and gloo (NCCL too) binds
the loopback interface. Across machines the ranks join by `env://`: docs/distributed.md
says which ports that opens. torchrun's own rendezvous store is its agent's, not the
ranks': `compress serve` has TorchServe start torchrun with `PET_RDZV_CONF=store_type=file`
(see docs/serving.md).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

LOOPBACK_INTERFACE = "lo"
STORE_PREFIX = ".process-group-"


def one_machine() -> bool:
    """Whether every rank of this torchrun job runs on this machine."""
    world = os.environ.get("WORLD_SIZE")
    return world is not None and world == os.environ.get("LOCAL_WORLD_SIZE")


def store_path(folder: Path) -> Path:
    """The FileStore of this torchrun job's attempt, in `folder`: named for torchrun's run
    id, its agent (every local rank's parent: its pid and start time) and the attempt, so a
    restarted or later job never reads the keys of an earlier one."""
    agent = os.getppid()
    try:  # field 22 of /proc/PID/stat: when it started, in clock ticks since boot
        started = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    run = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", "job"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return Path(folder) / f"{STORE_PREFIX}{run}-{agent}-{started}-{attempt}"


def join(folder: Path, timeout: timedelta = timedelta(minutes=30)) -> None:
    """Join this torchrun job's process group (gloo on CPU, NCCL on GPUs), unless joined:
    on one machine through a FileStore in `folder`, every collective on loopback; across
    machines by `env://`."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not one_machine():
        dist.init_process_group(backend, timeout=timeout)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_INTERFACE  # read as gloo's device is made
    os.environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_INTERFACE  # NCCL's bootstrap listener
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(str(store_path(folder)), ranks)
    dist.init_process_group(backend, store=store, rank=rank, world_size=ranks,
                            timeout=timeout)
