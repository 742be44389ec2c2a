"""The `int8_grouped` weight scheme: int8 weights in groups of `group_size` input channels,
each group with its own float32 scale and offset, and float32 activations; the input
embedding is stored the same way (shipped beside `lm_runtime.py`; imports torch only).

Why it exists: greedy decoding of a small LM sits on near-ties (SmolLM2-135M's top two
logits are within 0.1 of each other at 3.6% of its greedy steps), so any rounding of the
activations (bfloat16) or any weight grid coarser than the model's own flips tokens. Each
group is fitted on two grids and keeps the one that reproduces it better: affine (255 steps
from the group's minimum to its maximum) or symmetric (amax / 127). A weight that already
lies on such a grid, as a GGUF's Q4_1 (16 affine steps per 32) or Q8_0 (symmetric int8 per
32) groups do, is reproduced to float32 rounding.

Speed: compiled, at one to `DECODE_ROWS` rows, the forward is written as one
dequantize-multiply-sum, which Inductor compiles into a single vectorized loop that reads
each int8 weight once (a quarter of the float32 traffic); more rows (a prefill), or eager
mode, dequantize the weight and call the float32 matrix product. Inductor's freezing would
fold the dequantization into float32 constants and lose that, so the module says
`freeze_weights = False` and `StaticDecoder` compiles such models without freezing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SCHEME = "int8_grouped"
DECODE_ROWS = 4  # up to this many rows, the fused dequantize-and-reduce path


class GroupedInt8Linear(nn.Module):
    """A Linear whose weight is int8 in groups along the input: w = q * scale + offset."""

    freeze_weights = False  # read by StaticDecoder.compile (see the module docstring)

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"int8_grouped: group_size {group_size} does not divide a "
                             f"Linear's {in_features} input features; pick a divisor")
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, groups))
        self.register_buffer("offset", torch.zeros(out_features, groups))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int) -> GroupedInt8Linear:
        """An out x in float weight (and bias) fitted onto per-group int8 grids."""
        module = cls(weight.shape[1], weight.shape[0], bias is not None, group_size)
        q, scale, offset = fit_groups(weight.detach().float(), group_size)
        module.qweight.copy_(q)
        module.scale.copy_(scale)
        module.offset.copy_(offset)
        if bias is not None:
            module.bias.copy_(bias.detach().float())
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> GroupedInt8Linear:
        """The Linear's weight fitted onto per-group int8 grids (`fit_groups`)."""
        return cls.from_weight(linear.weight, linear.bias, group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, out_features x in_features."""
        return dequantize_groups(self.qweight, self.scale, self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > DECODE_ROWS or not torch.compiler.is_compiling():
            out = nn.functional.linear(x.float(), self.dequantize())
        else:  # sum over (group, member) of x * q * scale, plus offset * each group's sum of x
            groups = self.in_features // self.group_size
            xg = x.float().reshape(rows, 1, groups, self.group_size)
            q = self.qweight.view(self.out_features, groups, self.group_size)
            out = (xg * (q.float() * self.scale[..., None])).sum((-1, -2))
            out = out + (xg.sum(-1) * self.offset).sum(-1)
            out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}")


class GroupedInt8Embedding(nn.Module):
    """An embedding table stored as `GroupedInt8Linear` stores a weight: each looked-up row
    is dequantized (a tied head's table is the same Q8_0 tensor in a GGUF, kept exactly)."""

    def __init__(self, table: GroupedInt8Linear):
        super().__init__()
        self.table = table

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group_size: int) -> GroupedInt8Embedding:
        return cls(GroupedInt8Linear.from_weight(embedding.weight, None, group_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        return dequantize_groups(table.qweight[ids], table.scale[ids], table.offset[ids])


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                      ) -> torch.Tensor:
    """float32 values of int8 `q` (..., inputs) with a scale and offset per group of inputs
    (..., groups): q * scale + offset."""
    grouped = q.view(*scale.shape, -1).float()
    return (grouped * scale[..., None] + offset[..., None]).view(q.shape)


def fit_groups(weight: torch.Tensor, group_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 q, scale, offset) of a float32 weight: per group of `group_size` input channels
    the affine grid (255 steps over [min, max]) or the symmetric one (amax / 127, no offset),
    whichever has the smaller largest rounding error."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    affine_scale = ((high - low) / 255).clamp_min(1e-12)
    affine_offset = low + 128 * affine_scale
    affine_q = torch.round((groups - low[..., None]) / affine_scale[..., None]).clamp(0, 255) - 128
    symmetric_scale = (groups.abs().amax(-1) / 127).clamp_min(1e-12)
    symmetric_q = torch.round(groups / symmetric_scale[..., None]).clamp(-127, 127)

    zero = torch.zeros_like(low)

    def worst(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return (q * scale[..., None] + offset[..., None] - groups).abs().amax(-1)

    symmetric = (worst(symmetric_q, symmetric_scale, zero)
                 < worst(affine_q, affine_scale, affine_offset))
    q = torch.where(symmetric[..., None], symmetric_q, affine_q).to(torch.int8)
    scale = torch.where(symmetric, symmetric_scale, affine_scale)
    offset = torch.where(symmetric, zero, affine_offset)
    return q.reshape(rows, cols), scale, offset


def quantize_grouped(model: nn.Module, group_size: int,
                     filter_fn: Callable[[nn.Module, str], bool]) -> int:
    """Replace the Linears of `model` that `filter_fn(module, name)` picks (torchao
    `quantize_`'s filter) by `GroupedInt8Linear`s in place; how many were replaced."""
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and filter_fn(module, name)]
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, GroupedInt8Linear.from_linear(linear, group_size))
    return len(chosen)


def quantize_embedding(model: nn.Module, group_size: int) -> None:
    """The input embedding of a Hugging Face model as a `GroupedInt8Embedding`, in place
    (untie the output head from it first)."""
    table = model.get_input_embeddings()
    if isinstance(table, nn.Embedding):
        model.set_input_embeddings(GroupedInt8Embedding.from_embedding(table, group_size))
