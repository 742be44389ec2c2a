"""The grouped-weight C++ kernels, built here for this CPU (about 30 s the first time, so
outside the unit tier): every row count the kernel treats apart gives the dequantized
product through the kernel itself, not the torch fallback; the peers benchmark counts the
bytes of the kernel's records."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.kernels import _cpu_flags, build_error, grouped_mm_available

AVX512 = "avx512f" in _cpu_flags() and not os.environ.get("COMPRESS_KERNEL_MARCH")


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


@pytest.mark.parametrize("bits", [8, 4])
def test_up_to_5_rows_each_row_gets_its_one_row_product_bit_for_bit(bits) -> None:
    """What makes a speculative verification of 2-5 positions exact: the kernel sums each
    row as it sums a lone row."""
    torch.manual_seed(bits)
    module = grouped.GroupedLinear.from_linear(nn.Linear(576, 200), 32, bits)
    x = torch.randn(8, 576)
    alone = torch.cat([module(x[r:r + 1]) for r in range(8)])
    for rows in range(2, 6):
        assert torch.equal(module(x[:rows]), alone[:rows]), rows
    if AVX512:  # 6 rows and more: one sum a row, faster (the portable loop sums each row
        assert not torch.equal(module(x), alone)  # as a lone row at any count)


def test_int8_grouped_weights_count_the_kernel_records() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.causal_lm import child
    from serve.causal_lm.runtime.loading import quantize_weights

    torch.manual_seed(0)  # 1 layer, 32 wide, 64 in the MLP, 300 tokens, the table tied
    tiny = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)).eval()
    model = quantize_weights(tiny, "int8_grouped")  # head untied, table int8 too
    # the kernel's records: per tile of 16 outputs and group of 32 inputs, 1 byte a weight +
    # 16 float32 scales and offsets (random weights: not float16 values); down_proj has 2
    # groups a row; the head's 300 rows make 19 tiles (304 rows)
    linears = 40 * (32 + 16 + 16 + 32 + 64 + 64) + 80 * 32
    head, one_row = 304 * 40, 40  # the embedding: one row of codes, its scale and offset
    assert child.weight_bytes_per_token(model) == linears + 3 * 32 * 4 + head + one_row == 24104
    assert not any(getattr(m, "half_scales", False) for m in model.modules())
