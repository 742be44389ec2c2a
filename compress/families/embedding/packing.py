"""A sentence encoder that packs its batch: called like `SentenceEncoder` on a right-padded
batch, it keeps only the real tokens (those the attention mask keeps), runs them as one
sequence of all the batch's tokens, attention within each text on compress's
`packed_attention` kernel (serve/encoder_attention.cpp), and pools each text from its own
tokens. No padding is computed and a batch is one pass, whatever its lengths: a served batch
of short texts is no longer split into passes of similar length (`batching.by_length`), and
pays neither padding nor a pass's fixed cost more than once.

The packing is part of the graph (the kept positions of `attention_mask.nonzero()`, a
length the graph learns at run time), so a captured, quantized or AOTInductor-compiled
packed encoder keeps the padded signature (input_ids, attention_mask, token_type_ids) that
every measure, harness and server of compress calls. Each token keeps its position in its
row, as the padded model numbers it; `cls` pooling reads each text's first kept token (the
first position of a right-padded row). It runs where the kernel is built, in eval mode.
`encoder.PackedEncoder` is the module; this file holds how it computes."""

from __future__ import annotations

import torch
from torch import nn

from compress.errors import CompressError
from serve import encoder_attention

ATTENTION = "compress_packed"  # the transformers attention function a packed encoder uses


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over packed texts: `cu_seq_lens_q` holds their
    offsets along the one sequence (the mask is unused: there is no padding)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernel = getattr(torch.ops, encoder_attention.NAMESPACE).packed_attention
    return kernel(query, key, value, kwargs["cu_seq_lens_q"], float(scale)), None


def packed_forward(encoder: nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor,
                   token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A sentence encoder's embeddings of a right-padded batch from its real tokens only
    (`encoder`: its transformer, pooling modes and head, as `SentenceEncoder` holds them)."""
    if encoder.training:
        raise CompressError("a packed encoder runs in eval mode only (its attention "
                            "kernel has no backward)")
    rows, width = input_ids.shape
    kept = attention_mask.reshape(-1).nonzero().squeeze(1)  # flat positions of real tokens
    torch._check(kept.shape[0] >= 1)
    row = torch.div(kept, width, rounding_mode="floor")
    lengths = attention_mask.ne(0).sum(1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    tokens = encoder.transformer(
        input_ids=input_ids.reshape(-1)[kept][None],
        token_type_ids=types.reshape(-1)[kept][None],
        position_ids=(kept - row * width)[None],
        cu_seq_lens_q=offsets, cu_seq_lens_k=offsets).last_hidden_state[0]
    return encoder.head(torch.cat([pool_packed(tokens, row, offsets, rows, mode)
                                   for mode in encoder.modes], dim=-1))


def pool_packed(tokens: torch.Tensor, row: torch.Tensor, offsets: torch.Tensor, rows: int,
                mode: str) -> torch.Tensor:
    """One vector per text from packed `tokens` (tokens x width; `row[t]`: the text of token
    t, `offsets`: where each text begins and ends), as `encoder.pool` on the padded batch."""
    last = tokens.shape[0] - 1
    if mode == "cls":
        return tokens[offsets[:-1].clamp(max=last)]
    if mode == "lasttoken":
        return tokens[(offsets[1:] - 1).clamp(min=0)]
    width = tokens.shape[1]
    if mode == "max":
        lowest = tokens.new_full((rows, width), torch.finfo(tokens.dtype).min)
        return lowest.scatter_reduce(0, row[:, None].expand(-1, width), tokens, "amax")
    # each text's sum as one product with its tokens' membership (texts x tokens, 0 or 1):
    # a GEMM, where index_add compiles to an atomic add per element (~2 ms at 8 x 128)
    member = (row[None, :] == torch.arange(rows, device=row.device)[:, None]).to(tokens.dtype)
    if mode == "weightedmean":  # each token weighted by its position in its text, from 1
        position = torch.arange(tokens.shape[0], device=row.device) - offsets[row] + 1
        member = member * position.to(tokens.dtype)[None, :]
        return (member @ tokens) / member.sum(1, keepdim=True).clamp_min(1e-9)
    total = member @ tokens
    count = (offsets[1:] - offsets[:-1]).to(tokens.dtype).clamp_min(1e-9)[:, None]
    return total / (count.sqrt() if mode == "mean_sqrt_len" else count)


def use_packed_attention(transformer: nn.Module) -> None:
    """Switch `transformer` (a transformers model) to the packed attention; CompressError
    where compress's attention kernel cannot be built here."""
    if not encoder_attention.load():
        raise CompressError(f"a packed encoder needs compress's attention kernel, which "
                            f"could not be built here ({encoder_attention.error()})")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    transformer.set_attn_implementation(ATTENTION)
