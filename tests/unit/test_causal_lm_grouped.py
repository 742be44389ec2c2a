"""The grouped weight schemes (serve/causal_lm/runtime/grouped.py, int8_grouped and int4_grouped)
and their kernel (serve/causal_lm/runtime/csrc/grouped_kernels.cpp) on random weights and a tiny
random Llama whose weights sit on a GGUF's grids (Q4_1 body, Q8_0 head), as SmolLM2's do."""

from __future__ import annotations

import pytest
import torch
from builders import q4_1, q8_0
from torch import nn

from compress.families.causal_lm.algorithms import qat
from serve.causal_lm.runtime import grouped


def test_weights_on_a_gguf_grid_are_kept_and_others_rounded_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    for grid in (q4_1, q8_0):
        on_grid = grid(weight)
        q, scale, offset = grouped.fit_groups(on_grid, 32)
        back = q.view(96, 4, 32).float() * scale[..., None] + offset[..., None]
        assert (back.view(96, 128) - on_grid).abs().max() < 1e-6 * on_grid.abs().max()
        assert torch.allclose(grouped.dequantize_groups(q, scale, offset), back.view(96, 128))
    q, scale, offset = grouped.fit_groups(weight, 32)
    assert q.dtype == torch.int8 and scale.shape == offset.shape == (96, 4)
    back = (q.view(96, 4, 32).float() * scale[..., None] + offset[..., None]).view(96, 128)
    steps = scale.repeat_interleave(32, dim=1)
    assert ((back - weight).abs() <= 0.5001 * steps).all()
    assert (back - weight).abs().max() > 0  # random weights are rounded
    assert torch.equal(qat.fake_quantize(weight, "int8_grouped", 32), back)


def test_4_bit_codes_pack_two_a_byte_in_the_gguf_layout() -> None:
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = grouped.pack_nibbles(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4,
                                                                       codes[:, 16])
    assert torch.equal(packed[:, 16] & 15, codes[:, 32])
    assert torch.equal(grouped.unpack_nibbles(packed), codes)


def test_q4_1_weights_are_kept_by_4_bit_groups_to_float32_rounding() -> None:
    torch.manual_seed(2)
    weight = q4_1(torch.randn(64, 128) * 0.05)
    module = grouped.GroupedLinear.from_weight(weight, None, 32, bits=4)
    assert module.qweight.shape == (64, 64) and module.qweight.dtype == torch.uint8
    assert (module.dequantize() - weight).abs().max() < 1e-6 * weight.abs().max()
    rough = torch.randn(64, 128)  # off the grid: within half a step of 15 per group, give or
    module = grouped.GroupedLinear.from_weight(rough, None, 32, bits=4)  # take float16's
    steps = module.scale.repeat_interleave(32, dim=1)  # rounding of the step and minimum
    assert ((module.dequantize() - rough).abs() <= 0.52 * steps).all()
    assert torch.equal(module.scale.half().float(), module.scale)
    assert torch.equal(module.offset.half().float(), module.offset)
    assert torch.equal(qat.fake_quantize(rough, "int4_grouped", 32), module.dequantize())


def test_a_group_size_that_does_not_divide_the_inputs_is_one_line() -> None:
    with pytest.raises(ValueError, match="group_size 48 does not divide a Linear's 64 input"):
        grouped.GroupedLinear.from_linear(nn.Linear(64, 8), 48)
    with pytest.raises(ValueError, match="int4_grouped: group_size must be 32"):
        grouped.GroupedLinear.from_linear(nn.Linear(64, 8), 16, bits=4)
