"""Quantization-aware training of a causal LM: the fake grid and its straight-through gradient
(compress.families.causal_lm.algorithms.qat); the `quantize` mode qat stage through the
pipeline is in tests/integration/test_causal_lm_qat_runs.py."""

from __future__ import annotations

import torch
from torch import nn

from compress.families.causal_lm.algorithms import qat
from serve.causal_lm.runtime.loading import head_scheme_of, weight_config


def _dequantized(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight torchao's `quantize_` really computes with (read back through an identity
    input)."""
    from torchao.quantization import quantize_

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    layer.weight.data = weight.to(torch.bfloat16)
    quantize_(layer, weight_config(scheme, 32))
    with torch.inference_mode():
        return layer(torch.eye(weight.shape[1], dtype=torch.bfloat16)).T.float()


def test_the_fake_grid_is_the_grid_torchao_quantizes_onto() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.05
    for scheme, ratio in (("int4_weight_only", 0.1), ("int8_weight_only", 0.6)):
        snapped = qat.fake_quantize(weight, scheme, 32)
        raw_error = (_dequantized(weight, scheme) - weight).norm() / weight.norm()
        snapped_error = (_dequantized(snapped, scheme) - snapped).norm() / snapped.norm()
        # a weight already on the grid goes through the real kernels unchanged up to the
        # bf16 rounding of scales and of the read-back output (about 0.3%); an arbitrary
        # one loses 0.7% (int8) to 8% (int4)
        assert raw_error > 0.006, (scheme, raw_error)
        assert snapped_error < ratio * raw_error, (scheme, snapped_error, raw_error)


def test_prepare_fake_quantizes_each_linear_with_a_straight_through_gradient() -> None:
    layer = nn.Sequential(nn.Linear(64, 32, bias=False))
    model = nn.Module()
    model.body = layer
    model.lm_head = nn.Linear(64, 40, bias=False)
    model.get_input_embeddings = lambda: nn.Embedding(40, 64)
    assert qat.prepare(model, "int4_weight_only", 32, "float") == 1
    original = layer[0].parametrizations.weight.original
    assert torch.equal(layer[0].weight, qat.fake_quantize(original, "int4_weight_only", 32))
    layer[0](torch.ones(2, 64)).sum().backward()
    assert torch.equal(original.grad, torch.ones(32, 2) @ torch.ones(2, 64))
    qat.snap(model)
    assert isinstance(layer[0].weight, nn.Parameter) and not hasattr(layer[0], "parametrizations")
    assert head_scheme_of("int4_weight_only") == "int8_weight_only"
    assert head_scheme_of("int8_weight_only", "auto") == "int8_weight_only"
    assert head_scheme_of("int4_weight_only", "float") == "float"
