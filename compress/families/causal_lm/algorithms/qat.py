"""Quantization-aware training of a causal LM for torchao's weight schemes.

Each quantized Linear's weight is replaced in the forward pass by its quantize-dequantize
image on the grid the real scheme will use (int4: asymmetric min/max groups of
`group_size` along the input, as torchao's int4 CPU packing chooses them; int8: symmetric
per output channel; int8_grouped and int4_grouped: `fit_groups`'s per-group grids), with a
straight-through gradient. After training the weights are snapped onto that grid, so the
real `quantize_` afterwards reproduces them (up to the bfloat16 rounding of the scales) and
the quantized model is the one that was trained.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from serve.causal_lm.runtime.grouped import BITS, dequantize_groups, fit_groups
from serve.causal_lm.runtime.loading import head_scheme_of, untie_head


def fake_quantize(weight: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    """The weight on `scheme`'s grid (no gradient path: see `FakeQuantized`)."""
    if scheme == "int4_weight_only":
        groups = weight.reshape(-1, group_size)
        low, high = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(1e-8)
        levels = torch.clamp(torch.round((groups - low) / scale), 0, 15)
        return (levels * scale + low).reshape(weight.shape)
    if scheme in ("int8_weight_only", "int8_dynamic"):
        scale = (weight.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8)
        return torch.clamp(torch.round(weight / scale), -128, 127) * scale
    if scheme in BITS:
        fitted = fit_groups(weight.detach(), group_size, BITS[scheme])
        return dequantize_groups(*fitted).to(weight.dtype)
    raise ValueError(f"no fake quantization for scheme {scheme!r}")


class FakeQuantized(nn.Module):
    """Parametrization: the quantized weight forward, the identity backward."""

    def __init__(self, scheme: str, group_size: int) -> None:
        super().__init__()
        self.scheme, self.group_size = scheme, group_size

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            snapped = fake_quantize(weight, self.scheme, self.group_size)
        return weight + (snapped - weight).detach()


def prepare(model: nn.Module, scheme: str, group_size: int,
            head_scheme: str | None = None) -> int:
    """Fake-quantize every Linear as `quantize_weights` will quantize it (the output
    projection untied from the embedding first); the number of Linears prepared."""
    head = head_scheme_of(scheme, head_scheme)
    if head != "float":  # a float head stays tied to the embedding
        untie_head(model)
    prepared = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        chosen = head if name == "lm_head" else scheme
        if chosen == "float":
            continue
        parametrize.register_parametrization(module, "weight",
                                             FakeQuantized(chosen, group_size))
        prepared += 1
    return prepared


def snap(model: nn.Module) -> nn.Module:
    """Remove the parametrizations, leaving each weight on its grid."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model


@torch.no_grad()
def weight_change(model: nn.Module, reference: nn.Module) -> float:
    """How far `model`'s weights moved from `reference`'s (the model before `prepare`): the
    norm of the difference over the norm of the reference's weights, a fake-quantized
    Linear's latent weight compared with the plain weight it started from."""
    start = dict(reference.named_parameters(remove_duplicate=False))
    moved = size = 0.0
    for name, weight in model.named_parameters(remove_duplicate=False):
        before = start[name.replace("parametrizations.weight.original", "weight")]
        moved += float((weight - before).pow(2).sum())
        size += float(before.pow(2).sum())
    return (moved / size) ** 0.5 if size else 0.0
