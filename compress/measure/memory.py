"""Memory as measured, not computed: the peak resident memory of this process (read from
/proc by compress.system.processes), and the bytes of parameters, gradients and optimizer
state a process actually holds (under FSDP, its shards only)."""

from __future__ import annotations

from typing import Any

from compress.system.processes import peak_rss_mb, reset_peak_rss  # noqa: F401 (measured here)


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
