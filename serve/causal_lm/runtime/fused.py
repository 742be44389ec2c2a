"""A layer's kernel projections of one input as one kernel call (torch only; shipped beside
the runtime package): the query, key and value projections of an attention block, and the gate and
up projections of a feed-forward block. Decoding at batch 1 reads every weight once a token;
7 short products a layer spent more of their time starting (each call a fork of the threads
and a fresh memory stream) than 4 longer ones: SmolLM2's 30 layers' grouped products took
5.19 ms a token apart and 4.53 ms fused; a 2:4-pruned SmolLM2's int8_sparse24 products, its
grouped head with them, 8.37 ms apart and 7.12 ms fused (medians of 40 alternating passes;
benchmarks, 2-core Zen 4).

A kernel Linear (`FusableLinear`: `grouped.py`'s `GroupedLinear`, `sparse24.py`'s
`Sparse24Linear`) lays its weight out in records of 16 output features (`packed`) and says
which others its records can join (`fusion_key`) and how its kernel multiplies records
(`product`). `fuse_projections(model)` concatenates the records of each group
(`ProjectionGroup`, a child of the block, the records not saved) and registers a forward
pre-hook on the block that runs the group on the block's input and hands each projection its
slice, which the projection returns when the block calls it. Every output tile of 16
features is the same record as before, so each output is the same number, bit for bit.
Only blocks whose forward is known to give all its projections the block's own input are
fused (`BLOCKS`); the state dict is unchanged."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

# block class -> its projections of the block's input, in the order of their outputs
BLOCKS = {
    **{f"{family}Attention": ("q_proj", "k_proj", "v_proj")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen2Moe", "Qwen3Moe",
                      "Olmoe")},
    **{f"{family}MLP": ("gate_proj", "up_proj")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Olmoe")},
}
TILE = 16  # output features a kernel record holds (grouped_kernels.cpp, sparse24_kernel.cpp)


class FusableLinear(nn.Module):
    """A Linear multiplied by a compress kernel from records of 16 outputs (`packed`), which
    a `ProjectionGroup` can fuse with its block's other projections. A subclass keeps
    `packed`, `bias`, `in_features` and `out_features` and defines `fusion_key()` (what must
    be equal for records to be concatenated: kind, input size, layout), `product(x, packed,
    out_features)` (x @ the weight of `packed`'s records^T in float32, by its kernel) and
    `dequantize()` (its float32 weight, for where the kernel is not at hand)."""

    fusion_key: Callable[[], Hashable]
    product: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    dequantize: Callable[[], torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # its records are in its block's ProjectionGroup
        # (that group, first byte, end) of its records there, once fused
        self.fused_records: tuple[nn.Module, int, int] | None = None
        self.handed: torch.Tensor | None = None  # its output, handed over by that group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T (+ bias) in float32: by the kernel where it has records, else by the
        dequantized weight; a fused projection returns what its group handed it."""
        if self.handed is not None:
            return self.take_handed()
        if self.packed is not None:
            out = self.product(x, self.packed, self.out_features)
        else:
            out = nn.functional.linear(x.float(), self.dequantize())
        return out if self.bias is None else out + self.bias

    def take_handed(self) -> torch.Tensor | None:
        """The output its group handed over for this call (then forgotten), or None."""
        out, self.handed = self.handed, None
        return out

    def refuse_when_fused(self) -> None:
        """Loading weights into a fused projection would leave its group's records stale."""
        if self.fused:
            raise RuntimeError(f"{type(self).__name__}: load a state dict before "
                               "fuse_projections (a fused block computes from its own copy "
                               "of the records)")


class ProjectionGroup(nn.Module):
    """Kernel Linears of the same input, kind and layout as one product: their records
    concatenated (`packed`, not saved), their outputs split back."""

    def __init__(self, parts: list[FusableLinear]):
        super().__init__()
        first = parts[0]
        self.sizes = [p.out_features for p in parts]
        self.in_features, self.out_features = first.in_features, sum(self.sizes)
        self.product = first.product  # the kernel, with the parts' bits and modes
        self.register_buffer("packed", torch.cat([p.packed for p in parts]), persistent=False)
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        has_bias = any(p.bias is not None for p in parts)
        self.register_buffer("bias", torch.cat(biases) if has_bias else None, persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.product(x, self.packed, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.split(self.sizes, dim=-1)


def _fusable(parts: list[Any]) -> bool:
    """Kernel Linears with records, of one fusion key (kind, input size, layout), each a
    whole number of record tiles."""
    if not all(isinstance(p, FusableLinear) and p.packed is not None for p in parts):
        return False
    key = parts[0].fusion_key()
    return all(p.fusion_key() == key and p.out_features % TILE == 0 for p in parts)


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
        group = block.fused_projections = ProjectionGroup(parts)
        start = 0
        for part in parts:  # where its records went (read back by a released GroupedLinear)
            end = start + part.packed.numel()
            part.packed, part.fused, part.fused_records = None, True, (group, start, end)
            start = end
        block.register_forward_pre_hook(_hand_out, with_kwargs=True)
        fused += 1
    return fused


def unfuse_blocks(model: nn.Module) -> int:
    """Every fused block of `model` back to calling its own projections (its group and its
    pre-hook dropped), in place; how many blocks. For a model whose kernel projections were
    first replaced by plain Linears of their dequantized weights (an export that cannot run
    the kernels): a fused kernel projection left in place has its records in the group."""
    count = 0
    for block in model.modules():
        if not hasattr(block, "fused_projections"):
            continue
        for key, hook in list(block._forward_pre_hooks.items()):
            if hook is _hand_out:
                del block._forward_pre_hooks[key]
                block._forward_pre_hooks_with_kwargs.pop(key, None)
        del block.fused_projections
        count += 1
    return count
