"""The attention a `StaticDecoder` runs its model with: one new token per row over a static
KV cache, in float32, compiled into a few fused loops (torch and transformers only; shipped
beside `decode.py`); and, for a model whose products run on compress's kernels (which
give a row the same bits in any batch), the kernels' `cache_attention`, which keeps that
rule for the attention too, prefill chunks included (`invariant_attention`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

DECODE_ATTENTION = "compress_decode"  # the attention a StaticDecoder runs its model with
# ... where the model's products run on the kernels: every row's answer its own, bitwise
INVARIANT_ATTENTION = "compress_invariant"


def windowed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, decode_window: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys, values and mask cut to the first `len(decode_window)` cache positions (those
    written so far) where the window is given and the cut keeps the queries' attention: a
    mask says which positions each query reads, and without one a query of one token, or a
    whole prompt from position 0, is causal as it is."""
    if decode_window is None or (attention_mask is None
                                 and query.shape[2] not in (1, decode_window.shape[0])):
        return key, value, attention_mask
    filled = decode_window.shape[0]
    mask = attention_mask[..., :filled] if attention_mask is not None else None
    return key[:, :, :filled], value[:, :, :filled], mask


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     decode_window: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row over a static cache, in float32, each key-value
    head read once for its whole group of query heads (B x 1 x heads x dim out), over the
    first `len(decode_window)` cache positions only when that is given (the positions
    written so far: a dynamic size, so one compiled graph serves every length); longer
    queries (the prefill) go to transformers' SDPA attention, over those positions too
    (a 37-token prompt over the whole cache of 512 spent 14 of its 78 ms there).

    Compiled, this is a few fused loops. With SDPA the decode step called aten's CPU flash
    attention kernel, made for long queries: 378 us a layer for one query over 512 cached
    positions on SmolLM2, 11 of the 23 ms of an int8 decode step (torch.profiler)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value, attention_mask = windowed(query, key, value, attention_mask, decode_window)
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, _, dim = query.shape
    groups = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.view(rows, groups, heads // groups, 1, dim).float()
    scores = (grouped * key[:, :, None].float()).sum(-1) * scale  # rows, groups, per group, L
    if attention_mask is not None:
        mask = attention_mask[..., -1, :key.shape[2]].reshape(rows, 1, 1, -1)
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.float())
    weights = scores.softmax(-1)
    out = (weights[..., None] * value[:, :, None].float()).sum(-2)  # rows, groups, per group, dim
    return out.to(query.dtype).reshape(rows, 1, heads, dim), None


def invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        decode_window: torch.Tensor | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`decode_attention`'s contract, every query length, through the kernels'
    `cache_attention` (`csrc/cache_attention.cpp`): each row's sums run over its own
    attended positions in order from its first, so its answer is the same bits alone and
    in any batch, whatever the padding before it or the window read, and whatever chunks
    its prompt was prefilled in. Soft-capped, sink or sliding-window attention, and
    non-float32 queries, go to `decode_attention`."""
    if (query.dtype != torch.float32 or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("sliding_window") is not None):
        return decode_attention(module, query, key, value, attention_mask, dropout, scaling,
                                decode_window, **kwargs)
    key, value, attention_mask = windowed(query, key, value, attention_mask, decode_window)
    rows, _, length, dim = query.shape
    valid = None
    if attention_mask is not None:  # (rows or 1, 1, queries, cached): bool, or added
        mask = attention_mask[:, 0, -length:, :key.shape[2]]
        valid = (mask if mask.dtype == torch.bool else mask == 0).expand(
            rows, length, key.shape[2])
    scale = scaling if scaling is not None else dim ** -0.5
    out = torch.ops.compress_lm.cache_attention(query, key.float(), value.float(), valid,
                                                float(scale))
    return out, None


def register_decode_attention() -> None:
    """Make `decode_attention` and `invariant_attention` known to transformers (under
    DECODE_ATTENTION and INVARIANT_ATTENTION)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
    AttentionMaskInterface.register(INVARIANT_ATTENTION, sdpa_mask)


def decode_attention_for(model: nn.Module) -> str | None:
    """The attention a decoder runs `model` with, where the model's own is SDPA or eager
    (else None: its own): INVARIANT_ATTENTION where its weights are in the kernels' records
    (a module says `freeze_weights = False`) and the kernels are at hand, so that the whole
    step gives a row the same bits in any batch; else DECODE_ATTENTION."""
    own = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if own not in ("sdpa", "eager"):
        return None
    register_decode_attention()
    from .kernels import grouped_mm_available

    on_kernels = any(getattr(m, "freeze_weights", True) is False for m in model.modules())
    return INVARIANT_ATTENTION if on_kernels and grouped_mm_available() else DECODE_ATTENTION


@contextmanager
def attention(model: nn.Module, implementation: str | None) -> Iterator[None]:
    """Run `model` with another registered attention implementation (None: its own) for
    the duration, then give it back its own."""
    config = getattr(model, "config", None)
    own = getattr(config, "_attn_implementation", None)
    if implementation is None or config is None or own == implementation:
        yield
        return
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = own
