"""A request in flight in the continuous batcher (`batcher.py`): its `Row`, how its tokens
and its one end are sent (`Emit`), and `QueueFull`, the refusal past the waiting limit (torch
only; shipped in the `causal_lm` package)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.decode import Sampling

logger = logging.getLogger(__name__)

# emit(token, None) for each new token; then once emit(None, "stop" | "length" |
# "cancelled" | "error: ...")
Emit = Callable[[int | None, str | None], None]
CANCELLED = "cancelled"

class QueueFull(RuntimeError):
    """`submit` past `max_waiting` waiting rows; `retry_after_s`: when to try again."""

    def __init__(self, waiting: int, retry_after_s: int, what: str = "requests are waiting"):
        super().__init__(f"{waiting} {what}: try again in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Row:
    """One request in flight: its prompt, limits and where its tokens go."""

    ids: list[int]
    max_new_tokens: int
    emit: Emit
    sampling: Sampling | None = None
    tokens: list[int] = field(default_factory=list)
    start: int = 0  # its first cache position
    admitted: float = 0.0  # time.perf_counter() when its prefill began
    # rows decoding when it joined them with its first token, itself included (its answer's
    # X-Batch-Size: read then, not when the handler gets the token, by which time a row
    # with one token to make, or one of its request's other choices, may have left)
    beside: int = 0
    cancelled: bool = False  # set by `cancel`: the row leaves at the next step
    generator: torch.Generator | None = None
    queued: int = 0  # the batcher's step count when it was submitted
    ended: bool = False  # its end was emitted
    ignore_eos: bool = False  # an end token does not end it
    constraint: Any = None  # a `grammar.Constraint`: its tokens follow a grammar
    logprobs: int | None = None  # record each token's log-probability and this many rivals
    # per token, where `logprobs` is set: (its log-probability, [(rival id, its log-prob)])
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # the prompt's tokens after the first, as its prefill scores them (OpenAI's echo with
    # logprobs): each one's log-probability and its `logprobs` likeliest rivals
    score_prompt: bool = False
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # speculation (`speculation.py`): positions in its span it does not hold (refused
    # drafts, masked), and how often its drafts were kept (a running average)
    holes: int = 0
    acceptance: float | None = None
    # a draft found beside a plain step, scored by the tokens after it: (its first token's
    # index in `tokens`, the draft)
    shadow: tuple[int, list[int]] | None = None
    drafts_verified: int = 0  # its drafts checked, and kept (the engine's metrics)
    drafts_kept: int = 0

    def seed_sampling(self) -> None:
        """Greedy (no sampling) at temperature 0; a seeded sample its own generator."""
        how = self.sampling if self.sampling and self.sampling.temperature > 0 else None
        self.sampling = how
        if how is not None and how.seed is not None:
            self.generator = torch.Generator().manual_seed(how.seed)


def send(row: Row, token: int | None, end: str | None) -> bool:
    """`row.emit(token, end)`; False where it raised (its client is gone: the row leaves)."""
    try:
        row.emit(token, end)
    except Exception:  # noqa: BLE001 (one request's failure stays its own)
        logger.exception("compress batcher: a row's answer failed")
        return False
    return True

