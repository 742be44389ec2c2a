"""The repeated blocks of a transformer (BERT's `encoder.layer`, Llama's `model.layers`):
the unit FSDP shards by and activation checkpointing recomputes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of the model's longest `nn.ModuleList` whose entries are all of one class
    (at least two); empty when it has none (a plain MLP)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if (isinstance(module, nn.ModuleList) and len(module) > max(1, len(best))
                and len({type(block) for block in module}) == 1):
            best = list(module)
    return best


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    import torch
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():  # evaluation: nothing to keep or recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def checkpointed(blocks: list[nn.Module]) -> Iterator[None]:
    """Within the block, every block's forward keeps only its inputs and recomputes its
    activations during backward (`torch.utils.checkpoint`, non-reentrant); the blocks are
    left as they were afterwards (no wrapper modules, the same state-dict names)."""
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward  # the class's forward again
