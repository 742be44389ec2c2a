"""How the continuous batcher picks each row's next token from a step's logits: a row's
grammar (`grammar.Constraint`) masks its logits first, its log-probabilities are recorded
where it asked (those of the model's own logits, before the mask and the temperature), and
the grammar then follows the token picked (torch only; shipped in `causal_lm`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime.decode import NO_TOKEN, pick_tokens
from .rows import Row

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def pick_for_rows(logits: torch.Tensor, rows: Sequence[Row | None]) -> list[int]:
    """The next token of each row of `logits` (rows x vocab; a None row: a free slot, its
    token ignored; NO_TOKEN where a row's logits allow none). The logits of a row with a
    grammar are changed in place."""
    model_logprobs = {k: torch.log_softmax(logits[k].float(), dim=-1)
                      for k, row in enumerate(rows) if row and row.logprobs is not None}
    for k, row in enumerate(rows):
        if row is not None and row.constraint is not None:
            row.constraint.mask(logits[k])
    picked = pick_tokens(logits, [r.sampling if r else None for r in rows],
                         [r.generator if r else None for r in rows]).tolist()
    for k, row in enumerate(rows):
        if row is None or picked[k] == NO_TOKEN:  # its row ends (`batcher._take`)
            continue
        if k in model_logprobs:
            row.token_logprobs.append(token_logprobs(model_logprobs[k], picked[k],
                                                     row.logprobs or 0))
        if row.constraint is not None:
            row.constraint.advance(picked[k])
    return picked


def token_logprobs(logprobs: torch.Tensor, token: int, top: int
                   ) -> tuple[float, list[tuple[int, float]]]:
    """(the log-probability of `token`, the `top` likeliest ids with theirs)."""
    rivals: list[tuple[int, float]] = []
    if top > 0:
        values, ids = logprobs.topk(min(top, MAX_TOP_LOGPROBS, logprobs.numel()))
        rivals = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), rivals
