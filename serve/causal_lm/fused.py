"""A layer's grouped projections of one input as one kernel call (torch and `grouped.py`
only; shipped beside `runtime.py`): the query, key and value projections of an attention
block, and the gate and up projections of a feed-forward block. Decoding at batch 1 reads
every weight once a token; 7 short products a layer spent more of their time starting
(each call a fork of the threads and a fresh memory stream) than 4 longer ones: SmolLM2's
30 layers' products took 5.19 ms a token apart and 4.53 ms fused (benchmarks, 2-core Zen 4).

`fuse_projections(model)` concatenates the kernel records of each group (`ProjectionGroup`,
a child of the block, the records not saved) and registers a forward pre-hook on the block
that runs the group on the block's input and hands each projection its slice, which the
projection returns when the block calls it (`GroupedLinear.forward`). Every output tile of
16 features is the same record as before, so each output is the same number, bit for bit.
Only blocks whose forward is known to give all its projections the block's own input are
fused (`BLOCKS`); the state dict is unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .grouped import GroupedLinear, grouped_product

# block class -> its projections of the block's input, in the order of their outputs
BLOCKS = {
    **{f"{family}Attention": ("q_proj", "k_proj", "v_proj")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen2Moe", "Qwen3Moe",
                      "Olmoe")},
    **{f"{family}MLP": ("gate_proj", "up_proj")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Olmoe")},
}
TILE = 16  # output features a kernel record holds (grouped_kernels.cpp)


class ProjectionGroup(nn.Module):
    """Grouped Linears of the same input, shape and mode as one product: their records
    concatenated (`packed`, not saved), their outputs split back."""

    def __init__(self, parts: list[GroupedLinear]):
        super().__init__()
        first = parts[0]
        self.sizes = [p.out_features for p in parts]
        self.in_features, self.out_features = first.in_features, sum(self.sizes)
        self.bits, self.half_scales = first.bits, first.half_scales
        self.activations = first.activations
        self.register_buffer("packed", torch.cat([p.packed for p in parts]), persistent=False)
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        has_bias = any(p.bias is not None for p in parts)
        self.register_buffer("bias", torch.cat(biases) if has_bias else None, persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = grouped_product(self.activations)(x.float(), self.packed, self.out_features,
                                                self.bits, self.half_scales)
        if self.bias is not None:
            out = out + self.bias
        return out.split(self.sizes, dim=-1)


def _fusable(parts: list[Any]) -> bool:
    """Grouped Linears with records, of one input size, bit width, scale format and mode,
    each a whole number of record tiles."""
    if not all(isinstance(p, GroupedLinear) and p.packed is not None for p in parts):
        return False
    first = parts[0]
    return all(p.in_features == first.in_features and p.bits == first.bits
               and p.half_scales == first.half_scales
               and p.activations == first.activations
               and p.out_features % TILE == 0 for p in parts)


def _hand_out(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The block's pre-hook: its projections of its input, one product for them all."""
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    names = BLOCKS[type(block).__name__]
    for name, out in zip(names, block.fused_projections(x), strict=True):
        getattr(block, name).handed = out


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every known block of `model` whose parts allow it (see the
    module doc), in place; how many blocks. The parts keep their codes, scales and offsets
    (the state dict) but not their own records; load weights before fusing."""
    fused = 0
    for block in model.modules():
        names = BLOCKS.get(type(block).__name__)
        if not names or hasattr(block, "fused_projections"):
            continue
        parts = [getattr(block, name, None) for name in names]
        if not _fusable(parts):
            continue
        block.fused_projections = ProjectionGroup(parts)
        for part in parts:
            part.packed, part.fused = None, True
        block.register_forward_pre_hook(_hand_out, with_kwargs=True)
        fused += 1
    return fused
