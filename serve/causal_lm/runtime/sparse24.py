"""2:4 sparse weight schemes: `int8_sparse24` and `int4_sparse24` (shipped beside
the runtime package; imports torch and `kernels.py` only).

A 2:4 weight has at most 2 non-zeros in every 4 consecutive inputs (a "quad"; the `prune`
stage's n:m pattern makes them). Such a Linear keeps, per output and quad, the codes of its 2
kept values and their 2 positions in the quad (2 bits each), and per output and group of 32
inputs one scale: a symmetric grid (amax / 127 at 8 bits, amax / 7 at 4), the scale a
float16 value, no offset, so a pruned weight stays exactly 0. Decoding reads every weight
once per token: at 8 bits 0.69 bytes a weight against the dense grouped layout's 1.125-1.25,
at 4 bits 0.44 against 0.625-0.75.

Each module keeps its weight also in `sparse24_kernel.cpp`'s records (`packed`, rebuilt
whenever the weights are set or loaded, not saved), and its forward is that file's
`sparse24_mm`, exact to float32 rounding against the masked dequantized product; without the
kernel it dequantizes and calls the float32 product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .fused import FusableLinear
from .kernels import GROUP, grouped_mm_available

BITS = {"int8_sparse24": 8, "int4_sparse24": 4}  # scheme: bits per kept code
SCHEMES = tuple(BITS)
LEVELS = {8: 127, 4: 7}  # bits: largest code magnitude of the symmetric grid
TILE = 16  # output features per record, fixed by the kernel


class NotSparse24Error(ValueError):
    """A weight with more than 2 non-zeros in some group of 4 inputs."""


def check_24(weight: torch.Tensor, name: str) -> None:
    """Refuse (NotSparse24Error, one line) a weight that is not 2:4 along its inputs."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise NotSparse24Error(f"{name}: {cols} input features are not a multiple of "
                               f"{GROUP}, which the 2:4 schemes' groups need")
    dense = int(((weight.reshape(rows, cols // 4, 4) != 0).sum(-1) > 2).sum())
    if dense:
        raise NotSparse24Error(
            f"{name}: {dense} of its {rows * cols // 4} groups of 4 inputs hold more than 2 "
            "non-zeros; prune it with the n:m pattern (2:4) first, or keep it out of the "
            "scheme")


def fit_sparse24(weight: torch.Tensor, bits: int = 8
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, positions, scale) of a 2:4 float weight, out x in: the kept values' codes
    (out x in/2 int8, quad q's in columns 2q and 2q + 1), their positions in the quad (out x
    in/8 uint8: per quad a nibble, first position in bits 0-1, second in 2-3, quad 2b in
    byte b's low nibble and 2b + 1 in its high one), one float16-valued scale per 32 inputs
    (out x in/32 float32). Kept: the 2 largest |w| of each quad, in input order."""
    rows, cols = weight.shape
    quads = weight.detach().float().reshape(rows, cols // 4, 4)
    kept = quads.abs().topk(2, dim=-1).indices.sort(dim=-1).values  # rows x quads x 2
    values = quads.gather(-1, kept).reshape(rows, cols // GROUP, GROUP // 2)
    top = LEVELS[bits]
    scale = (values.abs().amax(-1) / top).half().float().clamp_min(2 ** -24)
    codes = torch.round(values / scale[..., None]).clamp(-top, top).to(torch.int8)
    nibbles = (kept[..., 0] | (kept[..., 1] << 2)).to(torch.uint8).reshape(rows, -1, 2)
    positions = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return codes.reshape(rows, cols // 2), positions, scale


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Kept codes (out x in/2 int8) as a module stores them: int8 at 8 bits; at 4 bits a byte
    a quad (uint8, out x in/4), its first code in the low nibble, signed."""
    if bits == 8:
        return codes.to(torch.int8)
    pairs = codes.view(torch.uint8).reshape(codes.shape[0], -1, 2) & 15
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes`: out x in/2 int8."""
    if bits == 8:
        return stored
    signed = stored.view(torch.int8)
    low, high = (signed << 4) >> 4, signed >> 4  # arithmetic shifts: sign-extended nibbles
    return torch.stack([low, high], dim=-1).reshape(stored.shape[0], -1)


def unpack_positions(positions: torch.Tensor) -> torch.Tensor:
    """out x in/8 position bytes -> out x quads x 2 positions (int64, 0..3)."""
    rows = positions.shape[0]
    nibbles = torch.stack([positions & 15, positions >> 4], dim=-1).reshape(rows, -1)
    return torch.stack([nibbles & 3, nibbles >> 2], dim=-1).long()


def dequantize_sparse24(stored: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor,
                        bits: int) -> torch.Tensor:
    """The dense float32 weight, out x in: each kept code times its group's scale at its
    position, every other weight 0."""
    codes = unpack_codes(stored, bits)
    rows, groups = scale.shape
    values = (codes.view(rows, groups, GROUP // 2).float() * scale[..., None])
    dense = torch.zeros(rows, groups * GROUP // 4, 4)
    dense.scatter_add_(-1, unpack_positions(positions), values.reshape(rows, -1, 2))
    return dense.reshape(rows, groups * GROUP)


def pack_records(stored: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """The weight in `sparse24_kernel.cpp`'s records (flat uint8): output features in tiles
    of 16 (the last padded with zero weights), per tile and group of 32 inputs its codes,
    positions and float16 scales, each output's byte beside the 15 others'."""
    rows, groups = scale.shape
    tiles = -(-rows // TILE)

    def lanes(table: torch.Tensor) -> torch.Tensor:  # out x (groups * per) bytes
        padded = torch.zeros(tiles * TILE, table.shape[1], dtype=torch.uint8)
        padded[:rows] = table.contiguous().view(torch.uint8)
        return padded.view(tiles, TILE, groups, -1)

    codes = lanes(stored).permute(0, 2, 3, 1)  # tiles x groups x slot bytes x 16 outputs
    where = lanes(positions).permute(0, 2, 3, 1)
    scales = lanes(scale.half().view(torch.uint8)).permute(0, 2, 1, 3)  # 16 outputs x 2 bytes
    parts = [part.reshape(tiles, groups, -1) for part in (codes, where, scales)]
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


class Sparse24Linear(FusableLinear):
    """A Linear whose weight is 2:4 sparse: kept codes, their positions, one scale per 32
    inputs (`fit_sparse24`'s tables; at 4 bits the codes two a byte, `pack_codes`)."""

    freeze_weights = False  # read by StaticDecoder.compile (as GroupedLinear's)

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int = 8):
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"2:4 weights: {in_features} input features are not a multiple "
                             f"of {GROUP}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        dtype = torch.int8 if bits == 8 else torch.uint8
        width = in_features // 2 if bits == 8 else in_features // 4
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=dtype))
        self.register_buffer("positions", torch.full((out_features, in_features // 8), 0x44,
                                                     dtype=torch.uint8))  # (0, 1) per quad
        self.register_buffer("scale", torch.ones(out_features, in_features // GROUP))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # the kernel's records

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 8, name: str = "linear"
                    ) -> Sparse24Linear:
        """The Linear's 2:4 weight on per-group symmetric grids; NotSparse24Error (naming
        `name`) where it is not 2:4."""
        check_24(linear.weight, name)
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, bits)
        codes, positions, scale = fit_sparse24(linear.weight, bits)
        module.qweight.copy_(pack_codes(codes, bits))
        module.positions.copy_(positions)
        module.scale.copy_(scale)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach().float())
        module.pack()
        return module

    def pack(self) -> None:
        """Lay the weight out in the kernel's records (`packed`), where the kernel is at
        hand."""
        if grouped_mm_available():
            self.packed = pack_records(self.qweight, self.positions, self.scale, self.bits)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.refuse_when_fused()
        super()._load_from_state_dict(*args, **kwargs)
        self.pack()

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight, out_features x in_features, pruned weights 0."""
        return dequantize_sparse24(self.qweight, self.positions, self.scale, self.bits)

    def fusion_key(self) -> tuple[object, ...]:
        return Sparse24Linear, self.in_features, self.bits

    def product(self, x: torch.Tensor, packed: torch.Tensor, out_features: int
                ) -> torch.Tensor:
        return torch.ops.compress_lm.sparse24_mm(x.float(), packed, out_features, self.bits)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, sparsity=2:4")


def quantize_sparse24(model: nn.Module, filter_fn: Callable[[nn.Module, str], bool],
                      bits: int = 8, fit: bool = True) -> int:
    """Replace the Linears of `model` that `filter_fn(module, name)` picks by
    `Sparse24Linear`s in place; how many were replaced. Every picked weight is checked
    first: one that is not 2:4 raises NotSparse24Error naming it, with the model untouched.
    `fit=False`: empty modules of the same shapes, for weights loaded next."""
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and filter_fn(module, name)]
    if fit:
        for name, linear in chosen:
            check_24(linear.weight, name)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = (Sparse24Linear.from_linear(linear, bits, name) if fit else
                  Sparse24Linear(linear.in_features, linear.out_features,
                                 linear.bias is not None, bits))
        setattr(parent, child, module)
    return len(chosen)
