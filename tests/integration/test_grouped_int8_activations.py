"""The grouped kernels' opt-in int8-activation product (serve/causal_lm/
grouped_int8_activations.cpp) against its reference: the activations rounded to int8 per
group of 32 as llama.cpp's Q8_0 blocks are (d = amax / 127, q = round(x / d)), then the exact
product with the dequantized weight; at every row count the kernel treats apart, both bit
widths, float16 and float32 scales. Also built for an AVX2-only CPU (no AVX-512: the
AVX2 integer path), so that path is checked on an AVX-512 machine too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from builders import grouped_module
from conftest import REPO, own_build

from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.kernels import build_error, grouped_mm_available

ROWS = [1, 2, 3, 7, 8, 9, 16, 17, 40]


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per group of 32 inputs and back: q * d."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.where(step > 0, torch.round(groups / safe), torch.zeros_like(groups))
    assert q.abs().max() <= 127
    return (q * step).reshape(x.shape)


def module_of(bits: int, half: bool, seed: int) -> grouped.GroupedLinear:
    return grouped_module(bits, half, seed, "int8")


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_int8_activation_product_is_the_rounded_activations_exact_product(
        bits, half) -> None:
    assert grouped_mm_available(), build_error()
    module = module_of(bits, half, bits + half)
    weight = module.dequantize().double()
    for rows in ROWS:
        x = torch.randn(rows, 96) * torch.rand(rows, 1) * 4
        x[0, :32] = 0  # a group of zeros rounds to zeros (its step is 0)
        got = module(x).double() - module.bias.double()
        exact = x.double() @ weight.T
        # rounded activations at every row count, one row (a decode step) included
        want = rounded(x).double() @ weight.T
        error = (got - want).abs().max() / want.abs().max()
        assert error < 1e-6, (rows, error)
        # and it is not the float32 product
        assert (got - exact).abs().max() / exact.abs().max() > 1e-4, rows


def test_the_int8_activation_product_keeps_leading_dimensions() -> None:
    module = module_of(8, True, 3)
    x = torch.randn(2, 5, 96)
    got = module(x)
    assert got.shape == (2, 5, 77)
    want = rounded(x).double() @ module.dequantize().double().T + module.bias.double()
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


CHILD = """
import json, sys, torch
from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime import kernels
assert kernels.grouped_mm_available(), kernels.build_error()
torch.manual_seed(0)
errors = {}
for bits in (8, 4):
    module = grouped.GroupedLinear.from_linear(torch.nn.Linear(96, 40), 32, bits)
    x = torch.randn(9, 96)
    weight = module.dequantize().double()
    groups = x.view(9, 3, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(groups / step) * step).view(9, 96)
    for name in ("float32", "int8"):
        module.activations = name
        got = module(x).double() - module.bias.double()
        want = (xq if name == "int8" else x).double() @ weight.T
        errors[f"{name}_{bits}"] = float((got - want).abs().max() / want.abs().max())
print(json.dumps({"errors": errors, "library": kernels.shipped_library().name}))
"""


def test_an_avx2_build_computes_both_products(avx2_kernels_env: dict[str, str]) -> None:
    """The kernels built for x86-64-v3 (AVX2 and FMA, no AVX-512: `COMPRESS_KERNEL_MARCH`)
    into the session's AVX2 cache, or this CPU's own build where it is AVX2-only (float32
    activations: the AVX2 path; int8 ones: the AVX2 integer path, vpmaddwd and vpmaddubsw)
    give the same products."""
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=avx2_kernels_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["library"] == grouped_kernels_library_here()) == own_build(avx2_kernels_env)
    assert all(error < 1e-6 for error in found["errors"].values()), found


def grouped_kernels_library_here() -> str:
    from serve.causal_lm.runtime.kernels import shipped_library

    return shipped_library().name
