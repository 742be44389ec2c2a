"""The grouped-weight C++ kernels, built here for this CPU (about 30 s the first time, so
outside the unit tier): every row count the kernel treats apart gives the dequantized
product through the kernel itself, not the torch fallback; each ISA path (AVX-512 where this
CPU has it, AVX2 and portable forced by `COMPRESS_KERNEL_MARCH`) against the dequantized
product, and every path's batch invariance; the peers benchmark counts the bytes of the
kernel's records."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch
from conftest import AVX2_FLAGS, REPO, kernels_env, own_build
from torch import nn

from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.kernels import (
    _cpu_flags,
    build_error,
    grouped_mm_available,
    grouped_mm_path,
    shipped_library,
)


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


@pytest.mark.parametrize("activations", grouped.ACTIVATIONS)
@pytest.mark.parametrize("bits", [8, 4])
def test_every_row_gets_its_one_row_product_bit_for_bit_at_any_row_count(
        bits, activations) -> None:
    """Batch invariance, in every activation mode on this CPU's path: a row's outputs are
    the same bits alone (a decode step of one row) and among 2-8 rows (batched decode,
    a speculative verification) or 13 and 40 (prefill chunks)."""
    torch.manual_seed(bits)
    module = grouped.GroupedLinear.from_linear(nn.Linear(576, 200), 32, bits)
    module.activations = activations
    x = torch.randn(40, 576) * torch.rand(40, 1) * 4
    alone = torch.cat([module(x[r:r + 1]) for r in range(40)])
    for rows in (*range(2, 9), 13, 40):
        assert torch.equal(module(x[:rows]), alone[:rows]), (grouped_mm_path(), rows)


PATH_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from builders import grouped_module
from serve.causal_lm.runtime import kernels
assert kernels.grouped_mm_available(), kernels.build_error()
ROWS = (1, 2, 3, 5, 8, 13, 128)
errors, invariant, invariant_int8 = {}, {}, {}
for bits in (8, 4):
    for half in (True, False):  # the four record layouts
        module = grouped_module(bits, half, bits + half, "float32")  # 96 -> 77
        weight = module.dequantize().double()
        def product(x):
            return torch.ops.compress_lm.grouped_mm(x, module.packed, 77, bits, half)
        torch.manual_seed(bits + half)
        x = torch.randn(max(ROWS), 96) * torch.rand(max(ROWS), 1) * 4
        def int8(x):
            return torch.ops.compress_lm.grouped_mm_int8(x, module.packed, 77, bits, half)
        alone = torch.cat([product(x[r:r + 1]) for r in range(max(ROWS))])
        alone_int8 = torch.cat([int8(x[r:r + 1]) for r in range(max(ROWS))])
        assert product(x[:0]).shape == (0, 77)
        for rows in ROWS:
            key = f"{bits}_{'half' if half else 'float'}_{rows}"
            got = product(x[:rows])
            want = x[:rows].double() @ weight.T
            errors[key] = float((got.double() - want).abs().max() / want.abs().max())
            invariant[key] = torch.equal(got, alone[:rows])
            invariant_int8[key] = torch.equal(int8(x[:rows]), alone_int8[:rows])
# the attention: each row of a left-padded batch against the row alone, cut to its positions
torch.manual_seed(7)
key, value = torch.randn(3, 2, 29, 64), torch.randn(3, 2, 29, 64)
query = torch.randn(3, 6, 1, 64)
starts = (0, 5, 17)
valid = torch.arange(29)[None, None, :] >= torch.tensor(starts)[:, None, None]
batch = torch.ops.compress_lm.cache_attention(query, key, value, valid, 0.125)
attention_invariant = [torch.equal(batch[r:r + 1], torch.ops.compress_lm.cache_attention(
    query[r:r + 1], key[r:r + 1, :, s:], value[r:r + 1, :, s:], None, 0.125))
    for r, s in enumerate(starts)]
print(json.dumps({"path": kernels.grouped_mm_path(), "errors": errors,
                  "invariant": invariant, "invariant_int8": invariant_int8,
                  "attention_invariant": attention_invariant,
                  "library": kernels.shipped_library().name}))
"""


@pytest.mark.parametrize(("march", "path"), [
    pytest.param("x86-64-v3", "avx2", marks=pytest.mark.skipif(
        not AVX2_FLAGS.issubset(_cpu_flags()),
        reason="this CPU lacks AVX2, FMA or F16C: an x86-64-v3 build would not run here")),
    pytest.param("x86-64", "portable", marks=pytest.mark.skipif(
        platform.machine() not in ("x86_64", "AMD64"), reason="not an x86-64 CPU"))])
def test_each_forced_path_computes_the_dequantized_product(
        avx2_kernels_env: dict[str, str], march: str, path: str) -> None:
    """Built for x86-64-v3 (AVX2, FMA, F16C, no AVX-512) or plain x86-64
    (`COMPRESS_KERNEL_MARCH`, each its own library; on an AVX2-only CPU its own build is the
    x86-64-v3 one), grouped_mm runs that path and gives the dequantized product at 1 to 128
    rows in all four record layouts (8 or 4 bits, float16 or float32 scales). On either path
    every row is also bitwise the row computed alone, at every row count, with float32 and
    with int8 activations, and the attention gives each row of a padded batch its alone
    answer."""
    env = kernels_env(avx2_kernels_env, march)  # x86-64-v3 on an AVX2-only CPU: its own build
    done = subprocess.run([sys.executable, "-c", PATH_CHILD], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["path"] == path, found["path"]
    assert (found["library"] == shipped_library().name) == own_build(env)
    assert len(found["errors"]) == 4 * 7
    bad = {key: error for key, error in found["errors"].items() if not error < 1e-6}
    assert not bad, bad
    assert all(found["invariant"].values()), found["invariant"]
    assert all(found["invariant_int8"].values()), found["invariant_int8"]
    assert found["attention_invariant"] == [True] * 3


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
