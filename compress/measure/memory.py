"""Memory as measured, not computed: the peak resident memory of this process, and the bytes
of parameters, gradients and optimizer state a process actually holds (under FSDP, its
shards only)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def reset_peak_rss() -> None:
    """Start a new peak of resident memory (Linux: clear_refs 5 resets VmHWM)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float | None:
    """Peak resident memory of this process since the last reset, in MB (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def held_bytes(tensors: Any) -> int:
    """Bytes of the storages behind `tensors` that this process holds (a DTensor counts its
    local shard; a storage shared by several tensors, such as tied weights, counts once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """What this process holds for training: parameter bytes and optimizer-state bytes."""
    import torch

    params = held_bytes(p for p in model.parameters())
    state = held_bytes(v for s in optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param_bytes": params, "optimizer_state_bytes": state}
