"""The grouped kernels' opt-in bfloat16-activation product (serve/causal_lm/
grouped_bf16_activations.cpp) against its reference: the activations rounded to bfloat16,
then the exact product with the dequantized weight, at every row count the kernel treats
apart, both bit widths, float16 and float32 scales, an output size that is no multiple of
16; one row is the float32 product bit for bit; compiled graphs call it as eager code does.
Where the kernels were built without AVX512-BF16 the operator is the float32 product, which
is checked instead (and is checked on this machine too, by a build for AVX2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from batcher_checks import varied_model
from builders import grouped_module
from conftest import REPO

from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.fused import ProjectionGroup
from serve.causal_lm.runtime.kernels import bf16_native, build_error, grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40]
pytestmark = pytest.mark.skipif(not grouped_mm_available(),
                                reason=f"the grouped kernels did not build: {build_error()}")
NATIVE = grouped_mm_available() and bf16_native()
NO_BF16 = "the kernels were built without AVX512-BF16 (not in this CPU's flags, or " \
    "COMPRESS_KERNEL_MARCH): grouped_mm_bf16 is the float32 product, checked instead"


def module_of(bits: int, half: bool, seed: int) -> grouped.GroupedLinear:
    return grouped_module(bits, half, seed, "bf16")


def product(module: grouped.GroupedLinear, x: torch.Tensor, activations: str) -> torch.Tensor:
    """The module's kernel product in an activation mode, bias apart."""
    return grouped.grouped_product(activations)(x, module.packed, module.out_features,
                                                module.bits, module.half_scales)


@pytest.mark.skipif(not NATIVE, reason=NO_BF16)
@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_bf16_product_is_the_rounded_activations_exact_product(bits, half) -> None:
    module = module_of(bits, half, bits + half)
    weight = module.dequantize().double()
    for rows in ROWS:
        x = torch.randn(rows, 96) * torch.rand(rows, 1) * 4
        x[0, :32] = 0  # a group of zeros
        got = product(module, x, "bf16")  # one row (a decode step) rounded too
        rounded = x.bfloat16().double()
        want = rounded @ weight.T
        # float32 summation's error, relative to the sum of the products' magnitudes
        scale = (rounded.abs() @ weight.abs().T).max()
        error = (got.double() - want).abs().max() / scale
        assert error < 1e-6, (rows, error)
        exact = x.double() @ weight.T  # and it is not the float32 product
        assert (got.double() - exact).abs().max() / scale > 1e-5


@pytest.mark.skipif(NATIVE, reason="AVX512-BF16 is at hand: the rounded product is checked")
@pytest.mark.parametrize("bits", [8, 4])
def test_without_avx512_bf16_the_product_is_the_float32_one(bits) -> None:
    module = module_of(bits, True, bits)
    for rows in ROWS:
        x = torch.randn(rows, 96)
        assert torch.equal(product(module, x, "bf16"), product(module, x, "float32"))


def test_the_bf16_product_keeps_leading_dimensions() -> None:
    module = module_of(8, True, 3)
    x = torch.randn(2, 5, 96)
    got = module(x)
    assert got.shape == (2, 5, 77)
    rounded = x.bfloat16() if NATIVE else x
    want = rounded.double() @ module.dequantize().double().T + module.bias.double()
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_a_compiled_module_calls_the_bf16_product_as_eager_code_does() -> None:
    module = module_of(4, True, 5)
    x = torch.randn(9, 96)
    compiled = torch.compile(module, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))


def test_a_quantized_model_in_the_bf16_mode_compiles_to_its_eager_logits() -> None:
    model = varied_model()
    quantize_weights(model, "int8_grouped", 32, activations="bf16")
    # a fused q/k/v or gate/up group multiplies by its first part's kernel (`product`)
    kernels = [m.product.__self__ if isinstance(m, ProjectionGroup) else m
               for name, m in model.named_modules()
               if isinstance(m, grouped.GroupedLinear | ProjectionGroup) and "embed" not in name]
    modes = {m.activations for m in kernels}
    assert modes == {"bf16"}  # the Linears, the head, the fused q/k/v and gate/up groups
    assert any(isinstance(m, ProjectionGroup) for m in model.modules())
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model)(ids).logits
    # Inductor may fuse the float32 work between the products (norms, attention) in another
    # order; the products themselves are the same operator calls
    assert (compiled - eager).abs().max() < 1e-4 * eager.abs().max()
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


CHILD = """
import json, torch
from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime import kernels
assert kernels.grouped_mm_available(), kernels.build_error()
torch.manual_seed(0)
same = {}
for bits in (8, 4):
    module = grouped.GroupedLinear.from_linear(torch.nn.Linear(96, 40), 32, bits)
    x = torch.randn(9, 96)
    module.activations = "bf16"
    rounded = module(x)
    module.activations = "float32"
    same[bits] = torch.equal(rounded, module(x))
print(json.dumps({"same": same, "native": kernels.bf16_native()}))
"""


def test_an_avx2_build_multiplies_in_float32(avx2_kernels_env: dict[str, str]) -> None:
    """The kernels built for x86-64-v3 (AVX2 and FMA, no AVX512-BF16:
    `COMPRESS_KERNEL_MARCH`) into the session's AVX2 cache, or this CPU's own build where it
    is AVX2-only: the bf16 mode is the float32 product."""
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=avx2_kernels_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"same": {"8": True, "4": True}, "native": False}
