"""Grouped weight schemes: `int8_grouped` (int8 codes) and `int4_grouped` (4-bit codes, two
a byte), each group of `group_size` input channels with its own float32 scale and offset,
and float32 activations; the input embedding is stored as int8 groups (shipped beside
the runtime package; imports torch and `kernels.py` only).

Why they exist: greedy decoding of a small LM sits on near-ties (SmolLM2-135M's top two
logits are within 0.1 of each other at 3.6% of its greedy steps), so any rounding of the
activations (bfloat16, or int8 as llama.cpp does) or any weight grid coarser than the
model's own flips tokens. At 8 bits each group is fitted on two grids and keeps the one
that reproduces it better: affine (255 steps from the group's minimum to its maximum) or
symmetric (amax / 127); at 4 bits on the affine grid of 15 steps. A weight that already lies
on such a grid, as a GGUF's Q8_0 (symmetric int8 per 32) and Q4_1 (16 affine steps per 32)
groups do, is reproduced to float32 rounding, so the model decodes the float model's tokens.

Speed: with groups of 32, each module keeps its weight also in `grouped_kernels.cpp`'s
layout (`packed`, rebuilt whenever the weights are set or loaded, not saved) and its
forward is that file's operator, which dequantizes each group in registers and multiplies
it with every activation row, reading the weight once per call (compiled graphs call it as
one extern kernel). Without it (no compiler, or another group size) the module dequantizes
the weight and calls the float32 product.
Inductor's freezing would fold the dequantization into float32 constants, so the modules say
`freeze_weights = False` and `StaticDecoder` compiles such models without freezing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .fused import FusableLinear
from .kernels import GROUP, grouped_mm_available

BITS = {"int8_grouped": 8, "int4_grouped": 4}  # scheme: bits per code
SCHEMES = tuple(BITS)
# activation modes: the exact float32 product, and the opt-in int8 and bf16 ones (`forward`)
ACTIVATIONS = ("float32", "int8", "bf16")


class GroupedLinear(FusableLinear):
    """A Linear whose weight is `bits`-bit codes in groups along the input:
    w = code * scale + offset. 8-bit codes are int8, one a byte; 4-bit codes are 0..15, two a
    byte, laid out per group as a GGUF's Q4 blocks (byte j: code j low, code j + 16 high)."""

    freeze_weights = False  # read by StaticDecoder.compile (see the module docstring)

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 bits: int = 8):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"grouped weights: group_size {group_size} does not divide a "
                             f"Linear's {in_features} input features; pick a divisor")
        if bits == 4 and group_size != GROUP:
            raise ValueError(f"int4_grouped: group_size must be {GROUP} (the 4-bit layout), "
                             f"not {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.bits = group_size, bits
        groups = in_features // group_size
        dtype, width = (torch.int8, in_features) if bits == 8 else (torch.uint8, in_features // 2)
        # unwritten: every value is set by `from_weight` or by the state dict loaded next (a
        # worker's modules are made before their weights: zeroed, they were a 195 MB peak)
        self.register_buffer("qweight", torch.empty(out_features, width, dtype=dtype))
        self.register_buffer("scale", torch.empty(out_features, groups))
        self.register_buffer("offset", torch.empty(out_features, groups))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # the kernel's layout
        self.half_scales = False  # whether `packed` holds float16 scales and offsets
        self.activations = "float32"  # one of ACTIVATIONS: see `forward`
        self.records_wanted = True  # False: never laid out for the kernel (an embedding's)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int, bits: int = 8, grid: str = "free") -> GroupedLinear:
        """An out x in float weight (and bias) fitted onto per-group grids (`fit_groups`)."""
        module = cls(weight.shape[1], weight.shape[0], bias is not None, group_size, bits)
        q, scale, offset = fit_groups(weight.detach().float(), group_size, bits, grid)
        module.qweight.copy_(q if bits == 8 else pack_nibbles(q))
        module.scale.copy_(scale)
        module.offset.copy_(offset)
        if bias is not None:
            module.bias.copy_(bias.detach().float())
        module.pack()
        return module

    def pack(self) -> None:
        """Lay the weight out for the kernel (`packed`), where the kernel is at hand, with
        float16 scales and offsets where they all are float16 values (`half_scales`)."""
        if self.records_wanted and self.group_size == GROUP and grouped_mm_available():
            self.half_scales = all(torch.equal(t.half().float(), t)
                                   for t in (self.scale, self.offset))
            self.packed = torch.ops.compress_lm.grouped_pack(
                self.qweight, self.scale, self.offset, self.bits, self.half_scales)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        if self.qweight is None and not any(key.startswith(prefix) for key in state_dict):
            return  # loaded and released already (`loading.load_releasing`): nothing to load
        self.refuse_when_fused()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.pack()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, bits: int = 8,
                    grid: str = "free") -> GroupedLinear:
        """The Linear's weight fitted onto per-group grids (`fit_groups`)."""
        return cls.from_weight(linear.weight, linear.bias, group_size, bits, grid)

    def sources(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scale, offset) as the state dict holds them: the buffers, or, once
        `release_sources` dropped them, read back from the kernel records (exactly: the
        records hold the same codes, and float16 scales only where they are float16 values)."""
        if self.qweight is not None:
            return self.qweight, self.scale, self.offset
        if self.fused_records is not None:
            group, start, end = self.fused_records
            records = group.packed[start:end]
        else:
            records = self.packed
        return unpack_records(records, self.out_features, self.in_features, self.bits,
                              self.half_scales)

    def release_sources(self) -> bool:
        """Drop the state dict's codes, scales and offsets where the kernel records hold the
        weight (a served model reads only the records; `sources` and the state dict read
        them back); whether they were dropped."""
        if self.qweight is None or (self.packed is None and self.fused_records is None):
            return False
        self.qweight = self.scale = self.offset = None
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.qweight is None:  # released: the same tensors, read back from the records
            for name, tensor in zip(("qweight", "scale", "offset"), self.sources(),
                                    strict=True):
                destination[prefix + name] = tensor

    def codes(self) -> torch.Tensor:
        """The codes, out_features x in_features (4-bit ones unpacked, as uint8)."""
        qweight = self.sources()[0]
        return qweight if self.bits == 8 else unpack_nibbles(qweight)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, out_features x in_features."""
        _, scale, offset = self.sources()
        return dequantize_groups(self.codes(), scale, offset)

    def fusion_key(self) -> tuple[object, ...]:
        return GroupedLinear, self.in_features, self.bits, self.half_scales, self.activations

    def product(self, x: torch.Tensor, packed: torch.Tensor, out_features: int
                ) -> torch.Tensor:
        """In the opt-in modes (`activations`), x is first rounded, every row by itself
        (a lone row too: batch invariance):
        "int8" to int8 per group of 32, as llama.cpp's Q8_0 blocks are
        (`grouped_int8_activations.cpp`), "bf16" to bfloat16 (`grouped_bf16_activations.cpp`,
        AVX512-BF16; exact float32 on a CPU without it)."""
        return grouped_product(self.activations)(x.float(), packed, out_features, self.bits,
                                                 self.half_scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bits={self.bits}")


def grouped_product(activations: str) -> Callable[..., torch.Tensor]:
    """The kernel operator of records for an activation mode (one of ACTIVATIONS)."""
    ops = torch.ops.compress_lm
    return {"float32": ops.grouped_mm, "int8": ops.grouped_mm_int8,
            "bf16": ops.grouped_mm_bf16}[activations]


class GroupedEmbedding(nn.Module):
    """An embedding table stored as an 8-bit `GroupedLinear` stores a weight: each looked-up
    row is dequantized (a tied head's table is the same Q8_0 tensor in a GGUF, kept
    exactly)."""

    def __init__(self, table: GroupedLinear):
        super().__init__()
        self.table = table
        # rows are looked up from the codes; the kernel never multiplies by the table (the
        # head is untied from it), so no records (31.8 MB for SmolLM2's at int8)
        table.records_wanted, table.packed = False, None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group_size: int, grid: str = "free"
                       ) -> GroupedEmbedding:
        return cls(GroupedLinear.from_weight(embedding.weight, None, group_size, 8, grid))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        return dequantize_groups(table.qweight[ids], table.scale[ids], table.offset[ids])


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A linear's or embedding's weight as float32 values (grouped ones dequantized: exactly),
    as a file format that stores them dense writes them."""
    table = module.table if isinstance(module, GroupedEmbedding) else module
    if isinstance(table, GroupedLinear):
        return table.dequantize().contiguous()
    return table.weight.detach().float().clone()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """rows x inputs codes 0..15 -> rows x inputs/2 bytes: per group of 32, byte j holds
    code j in its low nibble and code j + 16 in its high nibble."""
    rows, cols = codes.shape
    halves = codes.to(torch.uint8).view(rows, cols // GROUP, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`."""
    rows, width = packed.shape
    blocks = packed.view(rows, width * 2 // GROUP, GROUP // 2)
    return torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(rows, width * 2)


def unpack_records(records: torch.Tensor, out_features: int, in_features: int, bits: int,
                   half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scale, offset) as a `GroupedLinear` stores them, read back from its kernel
    records (`grouped_kernels.cpp`'s layout: per tile of 16 outputs and group of 32 inputs,
    the codes input by input, at 4 bits inputs 2p and 2p + 1 in a byte's low and high
    nibble, then 16 scales and 16 offsets, float16 where `half`)."""
    groups, tiles = in_features // GROUP, -(-out_features // 16)
    code_bytes = 16 * GROUP * bits // 8
    records = records.view(tiles, groups, -1)
    codes = records[..., :code_bytes]
    if bits == 8:
        by_input = codes.reshape(tiles, groups, GROUP, 16).view(torch.int8)
    else:
        pairs = codes.reshape(tiles, groups, GROUP // 2, 1, 16)
        by_input = torch.cat([pairs & 15, pairs >> 4], dim=3).reshape(tiles, groups, GROUP, 16)
    q = by_input.permute(0, 3, 1, 2).reshape(tiles * 16, in_features)[:out_features]
    values = records[..., code_bytes:].contiguous().view(torch.float16 if half else
                                                         torch.float32).float()
    values = values.reshape(tiles, groups, 2, 16).permute(2, 0, 3, 1).reshape(2, tiles * 16,
                                                                             groups)
    scale, offset = values[0, :out_features].clone(), values[1, :out_features].clone()
    qweight = q.contiguous() if bits == 8 else pack_nibbles(q)
    return qweight, scale, offset


def release_sources(model: nn.Module) -> int:
    """`GroupedLinear.release_sources` on every module of `model` that can: what a served
    model keeps is the kernel records alone (each weight was held twice); how many."""
    return sum(module.release_sources() for module in model.modules()
               if isinstance(module, GroupedLinear))


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                      ) -> torch.Tensor:
    """float32 values of codes `q` (..., inputs) with a scale and offset per group of inputs
    (..., groups): q * scale + offset."""
    grouped = q.view(*scale.shape, -1).float()
    return (grouped * scale[..., None] + offset[..., None]).view(q.shape)


GRIDS = ("free", "gguf", "compressed_tensors")  # fit_groups' choice of grid


def fit_groups(weight: torch.Tensor, group_size: int, bits: int = 8, grid: str = "free"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, offset) of a float32 weight. 8 bits: int8 codes, per group of
    `group_size` input channels the affine grid (255 steps over [min, max]) or the symmetric
    one (amax / 127, no offset), whichever has the smaller largest rounding error, except
    that a group a float16 grid reproduces to float32 rounding keeps that grid (a GGUF's
    Q4_1 group: 16 steps of a float16 size from a float16 minimum; Q8_0: amax / 127 in
    float16), so the kernel can hold its scales in float16 (`GroupedLinear.pack`). 4 bits:
    codes 0..15 (uint8, unpacked) on the affine grid of 15 steps from the group's minimum,
    step and minimum rounded to float16 first (as a GGUF's Q4_1 stores them, so its groups
    are kept exactly and the kernel's float16 copy loses nothing). `grid="gguf"` at 8 bits:
    every group on Q8_0's grid (symmetric, amax / 127 rounded to float16, codes rounded as
    llama.cpp rounds), so that a GGUF holds the weights exactly (4 bits: Q4_1's already).
    `grid="compressed_tensors"`: the grids of a compressed-tensors checkpoint, whose values
    are (code - zero point) x scale with an integer zero point: 8 bits as `gguf` (symmetric,
    the zero point 0: vLLM's int8 weight-only kernels take no other); 4 bits affine over the
    group's range stretched to hold 0, the step a float16 value and the minimum -zero point
    x step (so both dequantize to the same float32 values)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group_size, group_size)
    if grid == "compressed_tensors" and bits == 4:  # min-max: an outlier is never clipped
        low = groups.amin(-1).clamp_max(0)
        step = ((groups.amax(-1).clamp_min(0) - low) / 15).clamp_min(2 ** -14).half().float()
        zero = torch.round(-low / step).clamp(0, 15)
        q = (torch.round(groups / step[..., None]) + zero[..., None]).clamp(0, 15)
        return q.to(torch.uint8).reshape(rows, cols), step, -zero * step
    if grid in ("gguf", "compressed_tensors") and bits == 8:
        scale = (groups.abs().amax(-1) / 127).half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(groups / safe[..., None]).clamp(-127, 127)
        return q.to(torch.int8).reshape(rows, cols), scale, torch.zeros_like(scale)
    low, high = groups.amin(-1), groups.amax(-1)
    if bits == 4:
        low = low.half().float()
        scale = ((high - low) / 15).clamp_min(2 ** -14).half().float()
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return q.to(torch.uint8).reshape(rows, cols), scale, low
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
    q = torch.where(symmetric[..., None], symmetric_q, affine_q)
    scale = torch.where(symmetric, symmetric_scale, affine_scale)
    offset = torch.where(symmetric, zero, affine_offset)
    # float16 grids where they reproduce a group to float32 rounding
    tolerance = 2 ** -20 * groups.abs().amax(-1)
    q4, step4, low4 = fit_groups(weight, group_size, 4)
    q4 = q4.view(groups.shape).float()
    half_scale = symmetric_scale.half().float().clamp_min(2 ** -24)
    half_q = torch.round(groups / half_scale[..., None]).clamp(-127, 127)
    for grid_q, grid_scale, grid_offset in ((half_q, half_scale, zero), (q4, step4, low4)):
        exact = worst(grid_q, grid_scale, grid_offset) <= tolerance
        q = torch.where(exact[..., None], grid_q, q)
        scale = torch.where(exact, grid_scale, scale)
        offset = torch.where(exact, grid_offset, offset)
    return q.to(torch.int8).reshape(rows, cols), scale, offset


def quantize_grouped(model: nn.Module, group_size: int,
                     filter_fn: Callable[[nn.Module, str], bool], bits: int = 8,
                     fit: bool = True, activations: str = "float32", grid: str = "free"
                     ) -> int:
    """Replace the Linears of `model` that `filter_fn(module, name)` picks (torchao
    `quantize_`'s filter) by `GroupedLinear`s in place; how many were replaced. `fit=False`:
    empty modules of the same shapes, for weights loaded next from a state dict (fitting
    weights about to be replaced took 30 of a worker's 42 s start). `activations`: the
    modules' mode, one of ACTIVATIONS (`GroupedLinear.forward`); `grid`: `fit_groups`'s."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"grouped weights: activations {activations!r} is not one of "
                         f"{', '.join(ACTIVATIONS)}")
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and filter_fn(module, name)]
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = (GroupedLinear.from_linear(linear, group_size, bits, grid) if fit else
                  GroupedLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                group_size, bits))
        module.activations = activations
        setattr(parent, child, module)
    return len(chosen)


def quantize_embedding(model: nn.Module, group_size: int, fit: bool = True,
                       grid: str = "free") -> None:
    """The input embedding of a Hugging Face model as a `GroupedEmbedding`, in place
    (untie the output head from it first; `fit`: as `quantize_grouped`'s)."""
    table = model.get_input_embeddings()
    if isinstance(table, nn.Embedding):
        rows, width = table.weight.shape
        model.set_input_embeddings(GroupedEmbedding.from_embedding(table, group_size, grid)
                                   if fit
                                   else GroupedEmbedding(GroupedLinear(width, rows, False,
                                                                       group_size)))
