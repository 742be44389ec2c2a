"""Continuous batching over one static KV cache (shipped beside `lm_decode.py`; torch and
transformers only): a request that arrives while others decode joins at the next decode
step, and each row leaves when it is done.

How rows share the cache: one `StaticCache` of `rows` slots and `cache_len` positions, every
smaller bucket's cache a view of its first slots (`shared_caches`), so the step runs at the
smallest compiled bucket that holds the highest busy slot and no row moves. All rows write
their next token at one cursor position. A new row is prefilled alone (its own one-row
cache), and its keys and values are copied to the positions just before the cursor, in a
free slot; its mask opens its own positions only, and its rotary positions count from its
own first token, so rows of any lengths decode together. When the cursor would run past the
cache, every row's positions move left by the oldest row's start (`_compact`); a prompt
longer than the cursor moves them right. A request that cannot fit waits for rows to leave.

Both of the handler's batching paths decode at bucket sizes (`buckets`: each compiles once);
without continuous batching, a TorchServe batch decodes in `fitting_groups`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # in an export folder or an archive, lm_decode.py lies beside this file
    from lm_attention import attention
    from lm_decode import Sampling, StaticDecoder, pick_tokens
except ImportError:  # in the compress repository
    from serve.lm_attention import attention
    from serve.lm_decode import Sampling, StaticDecoder, pick_tokens

logger = logging.getLogger(__name__)

# emit(token, None) for each new token; emit(None, "stop" | "length" | "error: ...") once
Emit = Callable[[int | None, str | None], None]


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
    cancelled: bool = False  # set by `cancel`: the row leaves at the next step
    generator: torch.Generator | None = None


def shared_caches(decoders: dict[int, StaticDecoder]) -> None:
    """Give every decoder a cache that is a view of the first slots of the largest one's
    (initialized by a first `generate` on the largest), sharing its write positions."""
    largest = decoders[max(decoders)]
    from transformers import StaticCache

    for rows, decoder in decoders.items():
        if decoder is largest:
            continue
        cache = StaticCache(config=decoder.model.config, max_cache_len=decoder.max_cache_len)
        for mine, big in zip(cache.layers, largest.cache.layers, strict=True):
            mine.lazy_initialization(big.keys[:rows], big.values[:rows])
            mine.keys, mine.values = big.keys[:rows], big.values[:rows]
            mine.cumulative_length = big.cumulative_length
        decoder.cache, decoder.cache_rows = cache, rows


class ContinuousBatcher:
    """Decodes the rows of every submitted request on one thread, admitting new ones
    between steps. `decoders`: one per bucket size (compiled and warmed up), their caches
    already shared (`shared_caches`); `prefill`: an uncompiled decoder of the same model."""

    def __init__(self, decoders: dict[int, StaticDecoder], prefill: StaticDecoder,
                 stop: set[int], own_thread: bool = True):
        self.decoders, self.prefill, self.stop = decoders, prefill, stop
        self.rows = max(decoders)
        self.cache_len = prefill.max_cache_len
        self.cache = decoders[self.rows].cache
        self.slots: list[Row | None] = [None] * self.rows
        self.cursor = 0  # the cache position every row writes next
        self.mask = torch.ones(self.rows, self.cache_len, dtype=torch.long)
        self.waiting: collections.deque[Row] = collections.deque()
        self.wake = threading.Condition()
        self.steps = 0
        if own_thread:  # else the caller runs `serve` on the thread that built the model
            threading.Thread(target=self.serve, name="compress-batcher", daemon=True).start()

    def submit(self, row: Row) -> Row:
        """Queue a request; its tokens go to `row.emit` from the batcher's thread."""
        if len(row.ids) + row.max_new_tokens > self.cache_len:
            raise ValueError(f"prompt of {len(row.ids)} tokens + {row.max_new_tokens} new "
                             f"exceeds the cache of {self.cache_len}")
        if row.sampling is not None and row.sampling.temperature <= 0:
            row.sampling = None  # greedy
        if row.sampling is not None and row.sampling.seed is not None:
            row.generator = torch.Generator().manual_seed(row.sampling.seed)
        with self.wake:
            self.waiting.append(row)
            self.wake.notify()
        return row

    def cancel(self, row: Row) -> None:
        """Let a row go (its client left): it leaves at the next step, no more tokens."""
        row.cancelled = True
        with self.wake:
            self.wake.notify()

    def busy(self) -> int:
        """Rows decoding now."""
        return sum(r is not None for r in self.slots)

    def serve(self) -> None:
        """Decode forever: admit waiting requests, step the busy rows."""
        with torch.inference_mode(), attention(self.prefill.model, self.prefill.attention):
            while True:
                with self.wake:
                    while not self.waiting and not any(self.slots):
                        self.wake.wait()
                try:
                    self._admit()
                    if any(self.slots):
                        self._step()
                except Exception as exc:  # noqa: BLE001 (fail the rows, keep serving)
                    logger.exception("compress batcher: a step failed")
                    self._fail_all(f"error: {type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, oldest first, while they fit."""
        while True:
            with self.wake:
                while self.waiting and self.waiting[0].cancelled:
                    self.waiting.popleft().emit(None, "stop")
                if not self.waiting or None not in self.slots:
                    return
                row = self.waiting[0]
            if not self._make_room(len(row.ids), row.max_new_tokens):
                return
            with self.wake:
                self.waiting.popleft()
            slot = self.slots.index(None)
            row.admitted = time.perf_counter()
            logits = self.prefill.prefill(row.ids)
            length = len(row.ids)
            row.start = self.cursor - length
            for mine, one in zip(self.cache.layers, self.prefill.cache.layers, strict=True):
                mine.keys[slot, :, row.start:self.cursor] = one.keys[0, :, :length]
                mine.values[slot, :, row.start:self.cursor] = one.values[0, :, :length]
            self.mask[slot] = (torch.arange(self.cache_len) >= row.start).long()
            self.slots[slot] = row
            token = int(pick_tokens(logits, [row.sampling], [row.generator])[0])
            self._take(slot, token)

    def _make_room(self, length: int, new: int) -> bool:
        """Move the cursor so that a prompt of `length` tokens ends at it and `new` tokens
        fit after it (as do every busy row's); False if that cannot be done now."""
        busy = [r for r in self.slots if r is not None]
        if not busy:
            self._set_cursor(length)
            return True
        left = [r.max_new_tokens - len(r.tokens) for r in busy]
        if self.cursor + max(left + [new]) > self.cache_len:
            self._compact(min(r.start for r in busy))
        if length > self.cursor:
            self._shift(length - self.cursor)
        return self.cursor + max(left + [new]) <= self.cache_len and length <= self.cursor

    def _compact(self, by: int) -> None:
        """Every row's positions `by` to the left."""
        if by > 0:
            self._move(by, self.cursor, -by)

    def _shift(self, by: int) -> None:
        """Every row's positions `by` to the right, where the cache has room."""
        busy = [r for r in self.slots if r is not None]
        if self.cursor + by + max(r.max_new_tokens - len(r.tokens) for r in busy) <= \
                self.cache_len:
            self._move(0, self.cursor, by)

    def _move(self, begin: int, end: int, by: int) -> None:
        """Positions begin..end-1 of every slot to begin+by.., and the rows with them."""
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, begin + by:end + by] = t[:, :, begin:end].clone()
        self._set_cursor(self.cursor + by)
        for slot, row in enumerate(self.slots):
            if row is not None:
                row.start += by
                self.mask[slot] = (torch.arange(self.cache_len) >= row.start).long()

    def _set_cursor(self, position: int) -> None:
        """Every row writes at `position` next (each layer's write position with it; a step
        advances both by one)."""
        self.cursor = position
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(position)

    def _step(self) -> None:
        """One decode step of every busy row, at the smallest bucket holding them."""
        highest = max(i for i, r in enumerate(self.slots) if r is not None)
        size = min(b for b in self.decoders if b > highest)
        rows = self.slots[:size]
        tokens = torch.tensor([[r.tokens[-1] if r else 0] for r in rows])
        positions = torch.tensor([[self.cursor - r.start if r else 0] for r in rows])
        logits = self.decoders[size].decode_step(tokens, self.cursor, positions,
                                                 self.mask[:size], first=self.steps == 0)
        self.cursor += 1
        self.steps += 1
        picked = pick_tokens(logits, [r.sampling if r else None for r in rows],
                             [r.generator if r else None for r in rows]).tolist()
        for slot, row in enumerate(rows):
            if row is not None:
                self._take(slot, picked[slot])

    def _take(self, slot: int, token: int) -> None:
        """Give a row its new token, and let it go when it is done."""
        row = self.slots[slot]
        assert row is not None
        if row.cancelled:
            self._leave(slot, "stop")
            return
        row.tokens.append(token)
        row.emit(token, None)
        if token in self.stop or row.cancelled:
            self._leave(slot, "stop")
        elif len(row.tokens) >= row.max_new_tokens:
            self._leave(slot, "length")

    def _leave(self, slot: int, reason: str) -> None:
        row, self.slots[slot] = self.slots[slot], None
        if row is not None:
            row.emit(None, reason)

    def _fail_all(self, reason: str) -> None:
        for slot in range(self.rows):
            self._leave(slot, reason)


def rows_of(settings: dict[str, Any], batch_size: int) -> int:
    """Slots of the continuous batch: the handler's `rows`, else TorchServe's batchSize."""
    return max(1, int(settings.get("rows") or batch_size))


def buckets(batch_size: int) -> list[int]:
    """Decode batch sizes: powers of two below `batch_size`, and `batch_size`."""
    sizes = [1 << k for k in range(max(batch_size, 1).bit_length()) if 1 << k < batch_size]
    return sizes + [max(batch_size, 1)]


def fitting_groups(parsed: dict[int, Any], cache_len: int, largest: int) -> list[list[int]]:
    """The requests split, in order, into groups of at most `largest` whose longest prompt
    plus largest max_new_tokens fits the cache (left padding aligns every row's end)."""
    groups: list[list[int]] = []
    for i, request in parsed.items():
        group = groups[-1] if groups else None
        if group is not None and len(group) < largest:
            prompt = max(len(request.ids), *(len(parsed[j].ids) for j in group))
            new = max(request.max_new_tokens, *(parsed[j].max_new_tokens for j in group))
            if prompt + new <= cache_len:
                group.append(i)
                continue
        groups.append([i])
    return groups
