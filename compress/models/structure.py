"""A model's shapes after structured pruning: read them (`describe_shapes`), replay them on a
freshly built model of the same architecture (`apply_structure`), and the slicing both
pruning and replaying use."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PRUNABLE = (nn.Linear, nn.Conv2d)


def _slice_weights(module: nn.Linear | nn.Conv2d, out_idx: torch.Tensor | None,
                   in_idx: torch.Tensor | None) -> None:
    """Keep output rows `out_idx` and input columns `in_idx` of a weight (and the bias rows)."""
    weight = module.weight.detach()
    weight = weight if out_idx is None else weight[out_idx]
    module.weight = nn.Parameter(weight if in_idx is None else weight[:, in_idx].clone())
    if module.bias is not None and out_idx is not None:
        module.bias = nn.Parameter(module.bias.detach()[out_idx].clone())


def slice_linear(linear: nn.Linear, out_idx: torch.Tensor | None = None,
                 in_idx: torch.Tensor | None = None) -> None:
    """Keep the output features `out_idx` and input features `in_idx` of a Linear."""
    _slice_weights(linear, out_idx, in_idx)
    linear.out_features, linear.in_features = linear.weight.shape


def slice_conv(conv: nn.Conv2d, out_idx: torch.Tensor | None = None,
               in_idx: torch.Tensor | None = None) -> None:
    """Keep the output channels `out_idx` and input channels `in_idx` of a Conv2d."""
    if conv.groups != 1:
        raise ValueError("channel pruning supports ungrouped convolutions only")
    _slice_weights(conv, out_idx, in_idx)
    conv.out_channels, conv.in_channels = conv.weight.shape[:2]


def slice_batchnorm(norm: nn.BatchNorm2d, idx: torch.Tensor) -> None:
    """Keep the channels `idx` of a BatchNorm2d (affine parameters and running statistics)."""
    for name in ("weight", "bias", "running_mean", "running_var"):
        value = getattr(norm, name)
        if isinstance(value, nn.Parameter):
            setattr(norm, name, nn.Parameter(value.detach()[idx].clone()))
        elif value is not None:
            setattr(norm, name, value[idx].clone())
    norm.num_features = len(idx)


def set_heads(attention: nn.Module, n_heads: int) -> None:
    """Update the head count attributes that a BertSelfAttention's forward relies on."""
    attention.num_attention_heads = n_heads
    attention.all_head_size = n_heads * attention.attention_head_size


def describe_shapes(model: nn.Module) -> dict[str, Any]:
    """JSON-serialisable shapes of every Linear, Conv2d, BatchNorm2d and attention head count."""
    modules = {name: list(m.weight.shape[:2]) if isinstance(m, PRUNABLE) else [m.num_features]
               for name, m in model.named_modules() if isinstance(m, (*PRUNABLE, nn.BatchNorm2d))}
    heads = {name: int(m.num_attention_heads) for name, m in model.named_modules()
             if hasattr(m, "attention_head_size") and hasattr(m, "num_attention_heads")}
    return {"modules": modules, "attention_heads": heads}


def changed_shapes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The entries of `after` that differ from `before`."""
    return {section: {name: value for name, value in after[section].items()
                      if before[section].get(name) != value} for section in after}


def merge_structure(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`old` updated with the newer shapes of `new` (section by section)."""
    merged = dict(old or {})
    for section, entries in new.items():
        merged[section] = {**merged.get(section, {}), **entries}
    return merged


def apply_structure(model: nn.Module, structure: dict[str, Any]) -> None:
    """Shrink a freshly built model to the recorded shapes (weights are loaded afterwards)."""
    for name, shape in structure.get("modules", {}).items():
        module = model.get_submodule(name)
        indices = [torch.arange(size) for size in shape]
        if isinstance(module, nn.Conv2d):
            slice_conv(module, *indices)
        elif isinstance(module, nn.Linear):
            slice_linear(module, *indices)
        elif isinstance(module, nn.BatchNorm2d):
            slice_batchnorm(module, indices[0])
        else:
            raise ValueError(f"structure names {name}, a {type(module).__name__}: not resizable")
    for name, n_heads in structure.get("attention_heads", {}).items():
        set_heads(model.get_submodule(name), n_heads)
