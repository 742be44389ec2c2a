"""The grouped-weight C++ kernels, built here for this CPU (about 30 s the first time, so
outside the unit tier): every row count the kernel treats apart gives the dequantized
product through the kernel itself, not the torch fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serve import lm_grouped as grouped
from serve.lm_grouped_kernels import build_error, grouped_mm_available


def test_the_kernel_is_built_here() -> None:
    assert grouped_mm_available(), build_error()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 40])
def test_the_kernel_computes_the_dequantized_product(rows, bits) -> None:
    """Every row count the kernel treats apart (1-2 rows four weight rows at a time, up to 8
    two at a time, more in chunks of 8 over blocks), odd output counts included."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 77)
    module = grouped.GroupedLinear.from_linear(linear, 32, bits)
    x = torch.randn(rows, 1, 96)
    want = nn.functional.linear(x, module.dequantize(), linear.bias.detach())
    assert module.packed is not None  # the kernel's layout: the forward calls the kernel
    got = module(x)
    assert got.shape == (rows, 1, 77)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    # the fallback without the kernel (another group size takes it) agrees
    fallback = grouped.GroupedLinear.from_linear(linear, 16, bits) if bits == 8 else None
    if fallback is not None:
        assert torch.allclose(fallback(x), nn.functional.linear(
            x, fallback.dequantize(), linear.bias.detach()), atol=1e-5)

