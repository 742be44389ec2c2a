"""Structured pruning of a Llama-style causal LM: whole feed-forward neurons and whole
key-value groups of attention heads, the same number in every decoder layer (a Hugging Face
config holds one width for all layers), so the pruned model is a plain, smaller model of the
same architecture that saves, reloads, quantizes and splits like any other.

Importance is weight magnitude: a neuron's is the product of the L2 norms of its gate row,
its up row and its down column; a key-value group's is the sum of the norms of its key and
value rows and of its query heads' rows and output-projection columns. Each layer keeps its
most important units, in their original order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.families.causal_lm.algorithms.distill import decoder_layers


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _rows(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    return _linear(layer.weight[keep], None if layer.bias is None else layer.bias[keep])


def _columns(layer: nn.Linear, keep: torch.Tensor) -> nn.Linear:
    return _linear(layer.weight[:, keep], layer.bias)


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indexes of the `count` largest scores, in ascending index order."""
    return scores.topk(count).indices.sort().values


def prune_ffn(model: nn.Module, remove: int) -> int:
    """Remove `remove` feed-forward neurons from every layer; the width left."""
    width = 0
    for layer in decoder_layers(model):
        mlp = layer.mlp
        scores = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1)
                  * mlp.down_proj.weight.norm(dim=0))
        keep = _top(scores.float(), scores.numel() - remove)
        mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, keep), _rows(mlp.up_proj, keep)
        mlp.down_proj = _columns(mlp.down_proj, keep)
        width = keep.numel()
    model.config.intermediate_size = width
    return width


def prune_kv_groups(model: nn.Module, remove: int) -> tuple[int, int]:
    """Remove `remove` key-value groups (each with its query heads) from every layer;
    (query heads, key-value heads) left."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    groups = config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    if config.hidden_size % ((groups - remove) * per_group):
        raise ValueError(f"{groups - remove} key-value groups leave "
                         f"{(groups - remove) * per_group} query heads, which do not divide the "
                         f"hidden size {config.hidden_size} (transformers requires it); choose "
                         f"another amount")
    for layer in decoder_layers(model):
        attn = layer.self_attn

        def norms(weight: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
            split = weight.view(heads, head_dim, -1) if dim == 0 else \
                weight.view(weight.shape[0], heads, head_dim).transpose(0, 1)
            return split.float().flatten(1).norm(dim=1)

        scores = norms(attn.k_proj.weight, groups, 0) + norms(attn.v_proj.weight, groups, 0)
        scores += norms(attn.q_proj.weight, groups * per_group, 0).view(groups, -1).sum(1)
        scores += norms(attn.o_proj.weight, groups * per_group, 1).view(groups, -1).sum(1)
        kept = _top(scores, groups - remove)
        kv_rows = (kept[:, None] * head_dim + torch.arange(head_dim)).flatten()
        q_heads = (kept[:, None] * per_group + torch.arange(per_group)).flatten()
        q_rows = (q_heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
        attn.k_proj, attn.v_proj = _rows(attn.k_proj, kv_rows), _rows(attn.v_proj, kv_rows)
        attn.q_proj, attn.o_proj = _rows(attn.q_proj, q_rows), _columns(attn.o_proj, q_rows)
    config.head_dim = head_dim  # no longer hidden_size / heads
    config.num_key_value_heads = groups - remove
    config.num_attention_heads = (groups - remove) * per_group
    return config.num_attention_heads, config.num_key_value_heads


def prune_causal_lm(model: nn.Module, target: str, amount: float) -> dict[str, Any]:
    """Remove `amount` of the feed-forward neurons and/or key-value groups (`target`: ffn,
    heads or ffn+heads) from every layer in place; the new widths."""
    out: dict[str, Any] = {}
    config = model.config
    if "heads" in target:
        groups = config.num_key_value_heads
        remove = min(groups - 1, max(1, round(amount * groups)))
        if groups < 2:
            raise ValueError(f"the model has {groups} key-value group per layer: no head "
                             "group can go")
        out["attention_heads"], out["key_value_heads"] = prune_kv_groups(model, remove)
    if "ffn" in target:
        width = config.intermediate_size
        out["intermediate_size"] = prune_ffn(model, min(width - 1, max(1, round(amount * width))))
    return out
