"""The 2:4 sparse kernel (serve/causal_lm/runtime/csrc/sparse24_kernel.cpp, built with the grouped
kernels, so beside their tests outside the unit tier) and its layout (sparse24.py): at every
row count the kernel treats apart and both bit widths, the product is the dense masked
product (the dequantized 2:4 weight times the activations) to float32 rounding."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from serve.causal_lm.runtime import sparse24
from serve.causal_lm.runtime.kernels import _cpu_flags, build_error, grouped_mm_available

AVX512 = "avx512f" in _cpu_flags() and not os.environ.get("COMPRESS_KERNEL_MARCH")


def make_24(weight: torch.Tensor) -> torch.Tensor:
    """The weight with the 2 smallest |w| of every 4 consecutive inputs set to 0."""
    quads = weight.detach().clone().reshape(weight.shape[0], -1, 4)
    smallest = quads.abs().topk(2, dim=-1, largest=False).indices
    return quads.scatter(-1, smallest, 0.0).reshape(weight.shape)


def sparse_linear(inputs: int, outputs: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(inputs, outputs)
    with torch.no_grad():
        linear.weight.copy_(make_24(linear.weight))
    return linear


def masked_product(x: torch.Tensor, module: sparse24.Sparse24Linear) -> torch.Tensor:
    """The dense masked product in float64: x @ dequantized weight^T + bias."""
    return x.double() @ module.dequantize().double().T + module.bias.double()


def test_the_kernel_is_built_here() -> None:
    assert grouped_mm_available(), build_error()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 8, 17, 40])
def test_the_kernel_gives_the_dense_masked_product(rows, bits) -> None:
    """1-5 rows four partial sums, 6-8 one, more in chunks of 8; 77 outputs: a part tile."""
    linear = sparse_linear(96, 77, rows)
    module = sparse24.Sparse24Linear.from_linear(linear, bits)
    assert module.packed is not None  # the forward calls the kernel, not the fallback
    x = torch.randn(rows, 1, 96)
    got = module(x)
    assert got.shape == (rows, 1, 77) and got.dtype == torch.float32
    want = masked_product(x, module)
    bound = 1e-6 * (x.double().abs() @ module.dequantize().double().abs().T + 1)
    assert ((got.double() - want).abs() <= bound).all()
    # the fallback (no records) computes the same product
    module.packed = None
    assert torch.allclose(module(x), got, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kept_values_are_the_weight_on_its_grid_and_pruned_ones_stay_0(bits) -> None:
    linear = sparse_linear(64, 40, bits)
    with torch.no_grad():  # quads with fewer than 2 non-zeros, and an all-zero output
        linear.weight[0] = 0
        linear.weight[1, :4] = torch.tensor([0.0, 0.0, 0.5, 0.0])
    module = sparse24.Sparse24Linear.from_linear(linear, bits)
    weight = module.dequantize()
    assert torch.equal(weight[linear.weight == 0], torch.zeros(int((linear.weight == 0).sum())))
    step = module.scale.repeat_interleave(32, dim=1)
    assert ((weight - linear.weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(module.scale.half().float(), module.scale)  # float16 in the records
    x = torch.randn(3, 64)
    assert torch.allclose(module(x).double(), masked_product(x, module), atol=1e-5)


@pytest.mark.skipif(not AVX512, reason="the AVX-512 path's property (the portable one is "
                    "left to the compiler's vectorization)")
@pytest.mark.parametrize("bits", [8, 4])
def test_up_to_5_rows_each_row_gets_its_one_row_product_bit_for_bit(bits) -> None:
    """What a speculative verification of 2-5 positions needs, as grouped_mm gives it."""
    module = sparse24.Sparse24Linear.from_linear(sparse_linear(576, 200, bits), bits)
    x = torch.randn(8, 576)
    alone = torch.cat([module(x[r:r + 1]) for r in range(8)])
    for rows in range(2, 6):
        assert torch.equal(module(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("bits", [8, 4])
def test_a_module_loaded_from_a_state_dict_repacks_and_agrees(bits) -> None:
    fitted = sparse24.Sparse24Linear.from_linear(sparse_linear(64, 33, 5), bits)
    empty = sparse24.Sparse24Linear(64, 33, True, bits)
    empty.load_state_dict(fitted.state_dict())
    assert "packed" not in fitted.state_dict()
    x = torch.randn(2, 64)
    assert torch.equal(empty(x), fitted(x))


def test_the_records_hold_0_69_bytes_a_weight_at_8_bits_and_0_44_at_4() -> None:
    linear = sparse_linear(1024, 256, 0)
    for bits, per_weight in ((8, 0.6875), (4, 0.4375)):
        module = sparse24.Sparse24Linear.from_linear(linear, bits)
        assert module.packed.numel() == per_weight * 1024 * 256


def test_a_weight_that_is_not_2_4_is_refused_naming_its_layer() -> None:
    model = nn.Sequential(nn.Linear(64, 8))
    model.add_module("proj", sparse_linear(64, 8, 0))
    with pytest.raises(sparse24.NotSparse24Error) as caught:
        sparse24.quantize_sparse24(model, lambda module, name: True)
    message = str(caught.value)
    assert message.startswith("0: ") and "n:m pattern (2:4)" in message
    assert "\n" not in message
    assert isinstance(model[0], nn.Linear)  # nothing replaced
    with torch.no_grad():
        model[0].weight.copy_(make_24(model[0].weight))
    assert sparse24.quantize_sparse24(model, lambda module, name: True, bits=4) == 2
    assert isinstance(model.proj, sparse24.Sparse24Linear)
