"""Speculative decoding inside the continuous batch (`batcher.py`; torch and transformers
only, shipped in `causal_lm`): each busy row's drafts are looked up in its own prompt and
text so far (`speculative.draft_tokens`, prompt lookup), and one forward over every row's
[last token, d1..dk] at cache positions cursor..cursor+k verifies them all together: the
draft rows are batched as the decode rows are.

Each row keeps what plain decoding would have given it. Its token at each verified
position is picked as a decode step picks it (`pick_for_rows`: argmax, its own seeded
sample, its grammar, its log-probabilities), and the row goes on to the next position only
where that token is the draft the forward assumed; so a greedy row's tokens are its plain
tokens, and a sampled row draws from its generator exactly as it would have, one draw a
token. That takes the forward's logits at each position to equal a one-token step's there:
true for a model on compress's kernels (each row and query summed alone, the attention
over its own positions in order: `cache_attention.cpp`), not promised for a float model's
products (`docs/causal-lm.md`, batch invariance).

The positions a row did not keep (its refused drafts) stay behind in its span as holes:
its mask closes them (the attention skips them, so its sums are unchanged) and its rotary
positions count the positions it holds (`Row.holes`). Every row still writes at the one
cursor (`placement.py`).

Whether to speculate, and how far, is decided each step by measurement: a verification of
k drafts over `rows` rows costs what `rows x (k+1)` tokens cost (on a 2-core CPU the step
is compute-bound past a few rows: 4 rows x 5 positions took 3.6x a 4-row step, llm_int4),
and pays in the tokens the rows' acceptance rates promise: a row's own running rate, learnt
from its verifications and, where it takes plain steps, from the drafts it would have
verified (each checked against the tokens the steps then gave: no forward spent), the
batcher's before its first. Each (rows, k) is tried once, then its time is an average of
what it took; k = 0 is a plain step. A verification goes ahead only where it promises
`MARGIN` times a plain step's rate: the promise is an estimate, and one that falls short
costs a whole step (benchmarks/results/llm_batched_speculation.md: the `always` rows)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..runtime.attention import INVARIANT_ATTENTION, attention, decode_attention_for
from ..runtime.speculative import (
    VERIFY_ROWS_ATTENTION,
    draft_tokens,
    register_verify_attention,
)
from ..runtime.static_cache import cache_tensors
from .picking import pick_for_rows
from .rows import Row

# verify(rows, ids rows x k+1, cursor, position_ids rows x k+1, mask rows x cache_len) ->
# logits rows x k+1 x vocab, the keys and values written to the batcher's cache
Verify = Callable[[int, torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]
MARGIN = 1.1  # what a verification must promise over a plain step's tokens a second
SHORTEST_MATCH = 2  # tokens a draft's lookup matches at least (one matched too often in
# chat to pay: benchmarks/results/llm_speculative.md)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification of `k` drafts gives a row that keeps each draft with
    probability `acceptance` (until the first refused): 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def verify_attention_of(model: nn.Module) -> str:
    """The attention a verification runs `model` in, decided once: the kernels' where the
    model runs on them (each query its decode step's bits; inside the batcher's loop the
    model's config names it already), else `verify_attention` (a decode step's arithmetic
    query by query; a float model's products still sum as torch's GEMM does for more rows)."""
    register_verify_attention()
    own = getattr(model.config, "_attn_implementation", None)
    kernels = INVARIANT_ATTENTION in (own, decode_attention_for(model))
    return INVARIANT_ATTENTION if kernels else VERIFY_ROWS_ATTENTION


def verify_chunk(model: nn.Module, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                 position_ids: torch.Tensor, mask: torch.Tensor, window: torch.Tensor
                 ) -> torch.Tensor:
    """Every position's logits (rows x width x vocab) of `ids` (rows x width) written to
    `cache` at `positions`, attending to the first `len(window)` positions (run in
    `verify_attention_of(model)`)."""
    out = model(input_ids=ids, cache_position=positions, position_ids=position_ids,
                attention_mask=mask, past_key_values=cache, use_cache=True,
                decode_window=window)
    return out.logits


def eager_verify(model: nn.Module, caches: dict[int, Any]) -> Verify:
    """A verification through the model's own forward (`verify_chunk`), on the cache of
    each bucket (`caches`: rows -> cache)."""
    chosen = verify_attention_of(model)

    def verify(rows: int, ids: torch.Tensor, cursor: int, position_ids: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        width = ids.shape[1]
        with attention(model, chosen):
            return verify_chunk(model, caches[rows], ids,
                                torch.arange(cursor, cursor + width), position_ids, mask,
                                torch.empty(cursor + width, dtype=torch.int8))

    return verify


def package_verify(packages: dict[int, Any], caches: dict[int, Any], fallback: Verify,
                   most_drafts: int) -> Verify:
    """A verification through the shipped packages (`aot_steps.export_verify`, by the
    fewest rows each serves: 2..`most_drafts`+1 positions), else `fallback`."""
    def verify(rows: int, ids: torch.Tensor, cursor: int, position_ids: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        width = ids.shape[1]
        if not 2 <= width <= most_drafts + 1:
            return fallback(rows, ids, cursor, position_ids, mask)
        package = packages[max(k for k in packages if k <= rows)]
        return package(ids, torch.arange(cursor, cursor + width), position_ids, mask,
                       torch.empty(cursor + width, dtype=torch.int8),
                       *cache_tensors(caches[rows]))

    return verify


def verifier(model: nn.Module, decoders: dict[int, Any], drafts: int,
             packages: dict[int, Any]) -> Verify | None:
    """The batcher's verification for `drafts` drafts at most (None: off, or the model's
    attention is its own): through the shipped `packages` where there are some, else the
    model's forward; run once at the largest bucket (a package's first call allocates)."""
    rows = max(decoders)
    largest = decoders[rows]
    if drafts < 1 or getattr(largest, "attention", None) is None:
        return None
    caches = {rows: decoder.cache for rows, decoder in decoders.items()}
    verify = eager_verify(model, caches)
    if packages:
        verify = package_verify(packages, caches, verify, drafts)
    with torch.inference_mode():
        verify(rows, torch.zeros(rows, drafts + 1, dtype=torch.long), 0,
               torch.arange(drafts + 1).repeat(rows, 1),
               torch.ones(rows, largest.max_cache_len, dtype=torch.long))
    return verify


class Speculation:
    """The speculative turn of `ContinuousBatcher` (its state: `slots`, `cursor`, `mask`,
    `cache_len`, `steps`; its `_take`, `_set_cursor`, `_position`). `speculate`: the most
    drafts a row verifies at once (0: never); `verify`: the forward that verifies
    (`eager_verify`, `package_verify`)."""

    slots: list[Row | None]
    cursor: int
    mask: torch.Tensor
    cache_len: int
    steps: int
    step_s: float
    _take: Callable[[int, int], None]
    _set_cursor: Callable[[int], None]
    _position: Callable[[Row | None], int]

    def _speculation(self, speculate: int, verify: Verify | None) -> None:
        self.speculate = max(0, speculate) if verify is not None else 0
        self.verify = verify
        self.step_cost: dict[tuple[int, int], float] = {}  # (rows, drafts) -> seconds
        self.drafted = self.accepted = self.verifications = 0  # what `/metrics` may show
        self.acceptance = 0.5  # a running rate over every row: a new row's

    def _drafts(self, rows: Sequence[Row | None]) -> tuple[int, list[list[int] | None]]:
        """How many drafts to verify at this step (0: a plain step) and each slot's drafts
        (None: none found, or a free slot)."""
        busy = [r for r in rows if r is not None]
        left = max(r.max_new_tokens - len(r.tokens) for r in busy)
        most = min(self.speculate, self.cache_len - self.cursor - left)  # room past the rest
        if most < 1:
            return 0, []
        found = [draft_tokens(r.ids + r.tokens, k=most, n_min=SHORTEST_MATCH) or None
                 if r is not None else None
                 for r in rows]
        for row, draft in zip(rows, found, strict=True):
            if row is not None:
                self._shadow(row, draft)
        if not any(found):
            return 0, []
        size = len(rows)
        best, best_rate = 0, MARGIN * len(busy) / self._cost(size, 0)
        for k in range(1, most + 1):
            promised = sum(expected_tokens(self._acceptance_of(r) if d else 0.0, k)
                           for r, d in zip(rows, found, strict=True) if r is not None)
            rate = promised / self._cost(size, k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, [d[:best] if d else None for d in found]

    def _acceptance_of(self, row: Row) -> float:
        return self.acceptance if row.acceptance is None else row.acceptance

    def _shadow(self, row: Row, draft: list[int] | None) -> None:
        """Score the draft a row last had beside plain steps (`Row.shadow`) against the
        tokens made since, once they decide it (a token differs, or every draft is
        matched); then keep `draft` as the next one to score."""
        if row.shadow is not None:
            at, earlier = row.shadow
            made = row.tokens[at:at + len(earlier)]
            matched = next((i for i, (a, b) in enumerate(zip(made, earlier, strict=False))
                            if a != b), len(made))
            if matched == len(made) < len(earlier):
                return  # not decided yet: the next tokens will say
            self._learn(row, matched / len(earlier))
            row.shadow = None
        if draft:
            row.shadow = (len(row.tokens), draft)

    def _learn(self, row: Row, rate: float) -> None:
        """A row kept `rate` of a draft's tokens: its running rate and the batcher's."""
        row.acceptance = 0.7 * self._acceptance_of(row) + 0.3 * rate
        self.acceptance = 0.9 * self.acceptance + 0.1 * rate

    def _cost(self, size: int, k: int) -> float:
        """A step's measured time at `size` rows and `k` drafts; one not yet measured is
        taken to cost what a plain step does (so it is tried once)."""
        plain = self.step_cost.get((size, 0), self.step_s)
        return self.step_cost.get((size, k), plain)

    def _measured(self, size: int, k: int, seconds: float) -> None:
        before = self.step_cost.get((size, k))
        self.step_cost[size, k] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def _verify_step(self, rows: list[Row | None], k: int,
                     found: list[list[int] | None]) -> None:
        """One verification of `k` drafts of every busy row: each row keeps its tokens up
        to the first that differs from its draft (that one included), the positions after
        it become holes. A row with no draft found checks its last token repeated (its
        acceptance not counted)."""
        size, began_at = len(rows), self.cursor
        drafts = [d or ([r.tokens[-1]] * k if r else [0] * k) for r, d in zip(rows, found,
                                                                               strict=True)]
        ids = torch.tensor([[r.tokens[-1] if r else 0, *d] for r, d in zip(rows, drafts,
                                                                            strict=True)])
        first = torch.tensor([[self._position(r)] for r in rows])
        began = time.perf_counter()
        logits = self.verify(size, ids, self.cursor, first + torch.arange(k + 1),
                             self.mask[:size])
        self._measured(size, k, time.perf_counter() - began)
        self._set_cursor(self.cursor + k + 1)
        self.steps += 1
        self.verifications += 1
        going = {slot for slot, r in enumerate(rows) if r is not None}
        kept = dict.fromkeys(going, 0)
        for i in range(k + 1):
            if not going:
                break
            picked = pick_for_rows(logits[:, i], [r if s in going else None
                                                 for s, r in enumerate(rows)])
            for slot in sorted(going):
                row = rows[slot]
                assert row is not None
                self._take(slot, picked[slot])
                kept[slot] = i + 1
                if self.slots[slot] is not row or i == k or picked[slot] != drafts[slot][i]:
                    going.discard(slot)
        for slot, row in enumerate(rows):
            if row is None or self.slots[slot] is not row:
                continue
            holes = k + 1 - kept[slot]
            self.mask[slot, began_at + kept[slot]:began_at + k + 1] = 0
            row.holes += holes
            if found[slot]:
                self.drafted += k
                self.accepted += kept[slot] - 1
                row.drafts_verified += k
                row.drafts_kept += kept[slot] - 1
                self._learn(row, (kept[slot] - 1) / k)
            row.shadow = None  # this verification scored the drafts
