"""Magnitude pruning: unstructured (per layer), global (one threshold), structured.

Unstructured and global pruning zero weights in place (the same Parameter objects, no
reparametrisation left behind). Structured pruning physically removes BERT feed-forward
neurons and attention heads, or CNN output channels, and returns a `structure` dict of the
new shapes that `compress.models.structure.apply_structure` replays on a freshly built
model of the same architecture.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from compress.models.structure import (
    PRUNABLE,
    changed_shapes,
    describe_shapes,
    set_heads,
    slice_batchnorm,
    slice_conv,
    slice_linear,
)

CHANNEL_PRESERVING = (nn.ReLU, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Identity,
                      nn.MaxPool2d, nn.AvgPool2d, nn.Dropout, nn.Dropout2d)
Masks = dict[str, torch.Tensor]


def select_layers(model: nn.Module, include: list[str], exclude: list[str]) -> dict[str, nn.Module]:
    """Linear and Conv2d modules whose name matches an `include` and no `exclude` pattern."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, PRUNABLE)
            and any(fnmatch(name, pattern) for pattern in include)
            and not any(fnmatch(name, pattern) for pattern in exclude)}


def smallest_mask(scores: torch.Tensor, amount: float) -> torch.Tensor:
    """Boolean keep-mask of `scores` with exactly round(amount * numel) smallest entries off."""
    mask = torch.ones_like(scores, dtype=torch.bool)
    n_pruned = round(amount * scores.numel())
    if n_pruned > 0:
        pruned = torch.topk(scores.flatten(), n_pruned, largest=False).indices
        mask.view(-1)[pruned] = False
    return mask


def magnitude_masks(layers: dict[str, nn.Module], amount: float, method: str) -> Masks:
    """Keep-masks: `unstructured` prunes `amount` of each layer, `global` of all together."""
    weights = {name: m.weight.detach().abs() for name, m in layers.items()}
    if method == "unstructured":
        return {name: smallest_mask(w, amount) for name, w in weights.items()}
    if method != "global":
        raise ValueError(f"unknown magnitude pruning method '{method}'")
    keep = smallest_mask(torch.cat([w.flatten() for w in weights.values()]), amount)
    pieces = keep.split([w.numel() for w in weights.values()])
    return {name: piece.view_as(weights[name]) for name, piece in zip(weights, pieces, strict=True)}


@torch.no_grad()
def apply_masks(layers: dict[str, nn.Module], masks: Masks) -> None:
    """Zero the masked-out weights in place (the parameters stay the same objects)."""
    for name, mask in masks.items():
        layers[name].weight.mul_(mask.to(layers[name].weight.dtype))


def prune_magnitude(layers: dict[str, nn.Module], amount: float, method: str) -> Masks:
    """Prune `layers` to `amount` by magnitude; return the masks (permanent: plain weights)."""
    masks = magnitude_masks(layers, amount, method)
    apply_masks(layers, masks)
    return masks


def cubic_sparsity(step: int, total_steps: int, amount: float) -> float:
    """Sparsity at `step` of a cubic ramp from 0 to `amount` (Zhu & Gupta, 2017)."""
    progress = min(1.0, step / max(1, total_steps))
    return amount * (1.0 - (1.0 - progress) ** 3)


def layer_sparsity(layers: dict[str, nn.Module]) -> dict[str, float]:
    """Share of exact zeros in each layer's weight."""
    return {name: round(float((m.weight == 0).float().mean()), 6) for name, m in layers.items()}


def overall_sparsity(layers: dict[str, nn.Module]) -> float:
    """Share of exact zeros over the weights of all `layers` together."""
    zeros = sum(int((m.weight == 0).sum()) for m in layers.values())
    total = sum(m.weight.numel() for m in layers.values())
    return round(zeros / total, 6) if total else 0.0


def count_macs(model: nn.Module, example: Any) -> int:
    """Multiply-accumulates of the Linear and Conv2d layers in one forward pass of `example`."""
    macs = 0

    def count(module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        nonlocal macs  # one output value costs in_features (or in_channels x kernel) MACs
        macs += output.numel() * module.weight[0].numel()

    handles = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, PRUNABLE)]
    was_training = model.training
    try:
        model.eval()
        with torch.inference_mode():
            model(**example) if isinstance(example, dict) else model(example)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return macs












def survivors(scores: torch.Tensor, amount: float) -> torch.Tensor:
    """Sorted indices of the units kept when the `amount` share of lowest scores goes (>= 1)."""
    n_keep = max(1, len(scores) - round(amount * len(scores)))
    return torch.topk(scores, n_keep).indices.sort().values


def expand(units: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole blocks: unit u covers rows u*width ... (u+1)*width - 1."""
    return (units[:, None] * width + torch.arange(width)).flatten()


def bert_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Transformer layers with `attention.self`, `intermediate.dense` and `output.dense`."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "attention") and hasattr(getattr(m, "intermediate", None), "dense")
            and hasattr(getattr(m, "output", None), "dense")}


def prune_ffn(block: nn.Module, amount: float) -> None:
    """Remove the feed-forward neurons of smallest norm(row, bias) x norm(output column)."""
    inner, outer = block.intermediate.dense, block.output.dense
    rows = torch.cat([inner.weight.detach(), inner.bias.detach()[:, None]], dim=1)
    scores = rows.norm(dim=1) * outer.weight.detach().norm(dim=0)
    keep = survivors(scores, amount)
    slice_linear(inner, out_idx=keep)
    slice_linear(outer, in_idx=keep)


def prune_heads(block: nn.Module, amount: float) -> None:
    """Remove the heads of smallest norm(value rows, bias) x norm(output columns)."""
    attention, outer = block.attention.self, block.attention.output.dense
    n_heads, width = attention.num_attention_heads, attention.attention_head_size
    value = torch.cat([attention.value.weight.detach(), attention.value.bias.detach()[:, None]], 1)
    columns = outer.weight.detach().view(outer.out_features, n_heads, width)
    scores = value.view(n_heads, -1).norm(dim=1) * columns.norm(dim=(0, 2))
    rows = expand(survivors(scores, amount), width)
    for projection in (attention.query, attention.key, attention.value):
        slice_linear(projection, out_idx=rows)
    slice_linear(outer, in_idx=rows)
    set_heads(attention, len(rows) // width)


def prune_bert(model: nn.Module, layers: dict[str, nn.Module], target: str,
               amount: float) -> list[str]:
    """Structured pruning of the chosen BERT layers; return the names of the pruned units."""
    blocks = bert_blocks(model)
    if not blocks:
        raise ValueError(f"target {target} needs a BERT-style encoder (layers with attention, "
                         "intermediate.dense and output.dense)")
    pruned = []
    for name, block in blocks.items():
        if "ffn" in target and f"{name}.intermediate.dense" in layers:
            prune_ffn(block, amount)
            pruned.append(f"{name}.intermediate")
        if "heads" in target and f"{name}.attention.self.query" in layers:
            prune_heads(block, amount)
            pruned.append(f"{name}.attention.self")
    return pruned


def _shrink_consumers(following: list[tuple[str, nn.Module]], keep: torch.Tensor,
                      old_channels: int) -> None:
    """Fix the layers after a pruned Conv2d up to the next one that reads its channels."""
    flattened = False
    for name, module in following:
        if isinstance(module, nn.BatchNorm2d):
            slice_batchnorm(module, keep)
        elif isinstance(module, nn.Conv2d):
            slice_conv(module, in_idx=keep)
            return
        elif isinstance(module, nn.Linear) and flattened:
            slice_linear(module, in_idx=expand(keep, module.in_features // old_channels))
            return
        elif isinstance(module, nn.Flatten):
            flattened = True
        elif not isinstance(module, CHANNEL_PRESERVING):
            raise ValueError(f"cannot prune channels before layer {name} "
                             f"({type(module).__name__})")
    raise ValueError("the last convolution's channels are the model's output; exclude it")


def prune_channels(model: nn.Module, layers: dict[str, nn.Module], amount: float) -> list[str]:
    """Remove the output channels of smallest L1 norm of each chosen top-level Conv2d."""
    if not isinstance(model, nn.Sequential):
        raise ValueError("target channels needs an nn.Sequential CNN "
                         f"(got {type(model).__name__})")
    children = list(model.named_children())
    pruned = []
    for position, (name, conv) in enumerate(children):
        if name not in layers or not isinstance(conv, nn.Conv2d):
            continue
        old_channels = conv.out_channels
        keep = survivors(conv.weight.detach().abs().sum(dim=(1, 2, 3)), amount)
        _shrink_consumers(children[position + 1:], keep, old_channels)
        slice_conv(conv, out_idx=keep)
        pruned.append(name)
    if not pruned:
        raise ValueError("target channels: no chosen layer is a top-level Conv2d")
    return pruned










def prune_structured(model: nn.Module, layers: dict[str, nn.Module], target: str,
                     amount: float) -> tuple[list[str], dict[str, Any]]:
    """Remove units physically; return the pruned unit names and the changed shapes."""
    before = describe_shapes(model)
    if target == "channels":
        pruned = prune_channels(model, layers, amount)
    else:
        pruned = prune_bert(model, layers, target, amount)
    if not pruned:
        raise ValueError(f"target {target}: none of the chosen layers can be pruned this way")
    return pruned, changed_shapes(before, describe_shapes(model))
