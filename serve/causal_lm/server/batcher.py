"""Continuous batching over one static KV cache (shipped beside `decode.py`; torch and
transformers only): a request that arrives while others decode joins at the next decode
step, and each row leaves when it is done.

One `StaticCache` of `rows` slots, every smaller bucket's cache a view of its first slots
(`shared_caches`): the step runs at the smallest bucket holding the highest busy slot. The
requests admitted at one turn are prefilled together, in chunks between decode steps
(`prefill.py`), and each row's keys and values end just before the cursor that every row
writes at next (`placement.py`): its mask opens its own positions, its rotary positions
count from its first token. The first waiting requests that fit go in, unless the oldest
has waited `patience` steps. At most `max_waiting` wait (`submit` raises `QueueFull`),
counted from a request's arrival, before its body is parsed (`arrive`, `depart`): an
engine hands the worker every request at once, each with its body (up to the request
limit), so the bound must hold before the parse, not after it.

Every row gets exactly one end, `emit(None, reason)`: "stop" (an end token), "length"
(max_new_tokens), "cancelled" (`cancel`, in any state), or "error: Type: message" (its own
prefill failed: that row alone, a batch that failed is tried again row by row; a decode
step failed: every row in it), or UNUSABLE (its logits allowed no token: that row alone).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time

import torch

from serve.handler_settings import HandlerSettings

from ..runtime.attention import attention
from ..runtime.decode import NO_TOKEN, UNUSABLE, StaticDecoder
from ..runtime.static_cache import release
from .buckets import buckets, fitting_groups, shared_caches  # noqa: F401 (its API)
from .picking import pick_for_rows
from .placement import Placement
from .prefill import Prefiller, PrefillJob
from .rows import CANCELLED, Emit, QueueFull, Row, send  # noqa: F401 (its API)
from .speculation import Speculation, Verify

logger = logging.getLogger(__name__)


class ContinuousBatcher(Placement, Speculation):
    """Decodes the rows of every submitted request on one thread, admitting new ones
    between steps. `decoders`: one per bucket size (compiled and warmed up), their caches
    already shared (`shared_caches`); `prefiller`: prefills admitted prompts (over the
    same model and cache length); `max_waiting`: the queue's bound; `patience`: decode steps
    the oldest waiting request lets others that fit go first; `speculate`: the most drafts
    a row verifies in one step, through `verify` (`speculation.py`; 0: plain steps only)."""

    def __init__(self, decoders: dict[int, StaticDecoder], prefiller: Prefiller,
                 stop: set[int], own_thread: bool = True,
                 max_waiting: int = HandlerSettings.max_waiting,
                 patience: int = 32, speculate: int = HandlerSettings.speculate,
                 verify: Verify | None = None):
        self.decoders, self.prefiller, self.stop = decoders, prefiller, stop
        self.max_waiting, self.patience = max(1, max_waiting), max(0, patience)
        self.step_s = 0.05  # a decode step's time, averaged (`retry_after_s`)
        self.rows = max(decoders)
        self.cache_len = prefiller.cache_len
        self.cache = decoders[self.rows].cache
        self.job: PrefillJob | None = None  # the prompts being prefilled
        self.retry: collections.deque[Row] = collections.deque()  # alone, after a batch failed
        self.size = 0  # the bucket of the last step
        self.slots: list[Row | None] = [None] * self.rows
        self.cursor = 0  # the cache position every row writes next
        with torch.inference_mode():  # as the warm-up's masks: the graphs' guards match
            self.mask = torch.ones(self.rows, self.cache_len, dtype=torch.long)
        self.waiting: collections.deque[Row] = collections.deque()
        self.arriving = 0  # requests arrived, not yet submitted (`arrive`)
        self.wake = threading.Condition()
        self.steps = 0
        self._speculation(speculate, verify)
        if own_thread:  # else the caller runs `serve` on the thread that built the model
            threading.Thread(target=self.serve, name="compress-batcher", daemon=True).start()

    def submit(self, row: Row) -> Row:
        """Queue a request; its tokens go to `row.emit` from the batcher's thread."""
        return self.submit_all([row])[0]

    def submit_all(self, rows: list[Row]) -> list[Row]:
        """Queue a request's rows (its `n` choices) together, or none (QueueFull)."""
        for row in rows:
            if len(row.ids) + row.max_new_tokens > self.cache_len:
                raise ValueError(f"prompt of {len(row.ids)} tokens + {row.max_new_tokens} new "
                                 f"exceeds the cache of {self.cache_len}")
            row.seed_sampling()
        with self.wake:
            if len(self.waiting) + len(rows) > self.max_waiting:
                raise QueueFull(len(self.waiting), self._retry_after())
            for row in rows:
                row.queued = self.steps
            self.waiting.extend(rows)
            self.wake.notify()
        return rows

    def arrive(self) -> None:
        """Count a request from its arrival, before its body is parsed; QueueFull where the
        requests arrived and not yet submitted, and the rows waiting, already fill
        `max_waiting` (so a flood is refused while each request holds its body alone).
        Each `arrive` that returns is paired with one `depart`, before its `submit_all`."""
        with self.wake:
            held = self.arriving + len(self.waiting)
            if held >= self.max_waiting:
                raise QueueFull(held, self._retry_after())
            self.arriving += 1

    def depart(self) -> None:
        """A request counted by `arrive` is parsed (or failed): no longer counted."""
        with self.wake:
            self.arriving -= 1

    def _retry_after(self) -> int:
        """Seconds until the queue has likely moved: the tokens still to decode (rows in
        flight and waiting), spread over the slots, at the measured step time."""
        left = sum(r.max_new_tokens - len(r.tokens) for r in self.slots if r is not None)
        left += sum(r.max_new_tokens for r in self.waiting)
        return max(1, min(60, math.ceil(left / self.rows * self.step_s)))

    def cancel(self, row: Row) -> None:
        """Let a row go (its client left), in any state; it ends "cancelled" (once): at
        once where it waits, else at the batcher's next turn. Calling it again, or after the
        row ended, does nothing."""
        with self.wake:
            if row.cancelled or row.ended:
                return
            row.cancelled = True
            queue = next((q for q in (self.waiting, self.retry) if row in q), None)
            queued = queue is not None
            if queue is not None:
                queue.remove(row)
                row.ended = True
            self.wake.notify()
        if queued:
            send(row, None, CANCELLED)

    def busy(self) -> int:
        """Rows decoding now."""
        return sum(r is not None for r in self.slots)

    def idle(self) -> bool:
        """Nothing waits, is prefilled or decodes."""
        return not (self.waiting or self.retry or self.job or any(self.slots))

    def serve(self) -> None:
        """Decode forever: admit waiting requests, prefill a chunk, step the busy rows."""
        largest = self.decoders[self.rows]
        with torch.inference_mode(), attention(largest.model, largest.attention):
            while True:
                with self.wake:
                    while self.idle():
                        self.wake.wait()
                self.turn()

    def turn(self) -> None:
        """One turn of `serve`: free cancelled rows, start a prefill, run its next chunk
        (its rows join when it ends), one decode step of the busy rows."""
        try:
            self._sweep()
            self._admit()
            if self.job is not None:
                self._prefill_chunk()
            if any(self.slots):
                self._step()
        except Exception as exc:  # noqa: BLE001 (fail the rows, keep serving)
            logger.exception("compress batcher: a step failed")
            self._fail_all(f"error: {type(exc).__name__}: {exc}")

    def _sweep(self) -> None:
        """Free the slots of cancelled rows."""
        for slot, row in enumerate(self.slots):
            if row is not None and row.cancelled:
                self._leave(slot, CANCELLED)

    def _admit(self) -> None:
        """Start prefilling waiting requests, as many as there are free slots and they fit
        (and the prefiller's `max_rows` allows):
        the oldest that fit first, none past the oldest once it has waited `patience` steps
        (a request whose batch failed goes again alone, first)."""
        if self.job is not None:
            return
        free = self.slots.count(None)
        if not free:
            return
        if self.retry:
            self._start([self.retry.popleft()])
            return
        with self.wake:
            waiting = list(self.waiting)
        if not waiting:
            return
        if self.steps - waiting[0].queued >= self.patience:
            waiting = waiting[:1]  # the oldest has waited long enough: it goes next
        fitting = (r for r in waiting if self._place(len(r.ids), r.max_new_tokens))
        # no more checks than free slots; no more rows than a prefill takes at once
        chosen = list(itertools.islice(fitting, min(free, self.prefiller.max_rows or free)))
        with self.wake:
            chosen = [r for r in chosen if r in self.waiting]  # not cancelled meanwhile
            for row in chosen:
                self.waiting.remove(row)
        if chosen:
            self._start(chosen)

    def _start(self, rows: list[Row]) -> None:
        """Begin prefilling `rows` together (positions a prompt shares with a cached one
        copied in); a failure ends them (`_prefill_failed`)."""
        began = time.perf_counter()
        for row in rows:
            row.admitted = began
        try:
            self.job = self.prefiller.start(rows)
        except Exception as exc:  # noqa: BLE001 (these requests fail, the others go on)
            self._prefill_failed(rows, exc)

    def _prefill_chunk(self) -> None:
        """The job's next chunk (all of it where no row decodes); its rows join once done."""
        job = self.job
        assert job is not None
        try:
            self.prefiller.step(job, not any(self.slots), self.step_s)  # ~a step's time
        except Exception as exc:  # noqa: BLE001 (these requests fail, the others go on)
            self.job = None
            self._prefill_failed(job.rows, exc)
            return
        if not job.finished:
            return
        self.job = None
        for index, row in enumerate(job.rows):
            self._join(job, index, row)
        self.prefiller.release(job)  # its rows' keys and values are in their slots now

    def _prefill_failed(self, rows: list[Row], exc: Exception) -> None:
        """A batch's rows go again one at a time; a row alone ends with the error."""
        logger.error("compress batcher: a prefill of %d row(s) failed%s", len(rows),
                     "; each goes again alone" if len(rows) > 1 else "", exc_info=exc)
        if len(rows) > 1:
            self.retry.extend(rows)
        else:
            self._end(rows[0], CANCELLED if rows[0].cancelled else
                      f"error: {type(exc).__name__}: {exc}")

    def _join(self, job: PrefillJob, index: int, row: Row) -> None:
        """Place a prefilled row in a free slot (its keys and values copied just before the
        cursor) and give it its first token; back to the front of the queue where it no
        longer fits (its prompt is cached: prefilling it again is cheap)."""
        if row.cancelled:
            self._end(row, CANCELLED)
            return
        if row.score_prompt:
            row.prompt_logprobs = job.prompt_scores(index)
        if row.max_new_tokens == 0:  # its prompt alone (OpenAI's echo): no slot, no token
            self._end(row, "length")
            return
        length = len(row.ids)
        if None not in self.slots or not self._place(length, row.max_new_tokens):
            with self.wake:
                self.waiting.appendleft(row)
            return
        try:
            self._place(length, row.max_new_tokens, move=True)
        except Exception as exc:  # the cache may be torn: every row fails (`turn`)
            self._end(row, f"error: {type(exc).__name__}: {exc}")
            raise
        slot = self.slots.index(None)
        row.start = self.cursor - length
        keys, values = self.prefiller.keys_values(job, index)
        self._fill(slot, row.start, keys, values)
        (token,) = pick_for_rows(job.row_logits(index), [row])
        self.slots[slot] = row
        row.beside = self.busy()
        self._take(slot, token)

    def _step(self) -> None:
        """One decode step of every busy row, at the smallest bucket holding them."""
        highest = max(i for i, r in enumerate(self.slots) if r is not None)
        size = min(b for b in self.decoders if b > highest)
        rows = self.slots[:size]
        if self.steps % 16 == 0:  # a free slot's row still steps: what it wrote goes back
            for slot in range(size):
                if self.slots[slot] is None:
                    release(self.cache, slot)
        drafts, found = self._drafts(rows) if self.speculate else (0, [])
        if drafts:
            self._verify_step(rows, drafts, found)
            return
        tokens = torch.tensor([[r.tokens[-1] if r else 0] for r in rows])
        positions = torch.tensor([[self._position(r)] for r in rows])
        began = time.perf_counter()
        # Dynamo's guards are checked in full where the bucket changes (`StaticDecoder._stance`)
        logits = self.decoders[size].decode_step(tokens, self.cursor, positions,
                                                 self.mask[:size], first=size != self.size)
        self.size = size
        spent = time.perf_counter() - began
        self.step_s = 0.9 * self.step_s + 0.1 * spent
        if self.speculate:
            self._measured(size, 0, spent)
        self.cursor += 1
        self.steps += 1
        picked = pick_for_rows(logits, rows)
        for slot, row in enumerate(rows):
            if row is not None:
                self._take(slot, picked[slot])

    def _take(self, slot: int, token: int) -> None:
        """Give a row its new token, and let it go when it is done."""
        row = self.slots[slot]
        assert row is not None
        if row.cancelled:
            self._leave(slot, CANCELLED)
            return
        if token == NO_TOKEN:  # its logits allowed no token: it alone ends
            self._leave(slot, UNUSABLE)
            return
        row.tokens.append(token)
        if not send(row, token, None):
            self._leave(slot, CANCELLED)
        elif token in self.stop and not row.ignore_eos:
            self._leave(slot, "stop")
        elif len(row.tokens) >= row.max_new_tokens:
            self._leave(slot, "length")

    def _leave(self, slot: int, reason: str) -> None:
        row, self.slots[slot] = self.slots[slot], None
        # a free slot inside the step's bucket still runs: with every position open it
        # never attends to nothing (a row's old mask could, once a move took the cursor
        # below its start: softmax of all -inf is NaN, written into the cache, and 0 x NaN
        # poisoned the next row placed in the slot)
        self.mask[slot] = 1
        release(self.cache, slot)  # its positions are read no more
        if row is not None:
            self._end(row, reason)

    def _end(self, row: Row, reason: str) -> None:
        """Emit a row's end, once."""
        with self.wake:
            if row.ended:
                return
            row.ended = True
        send(row, None, reason)

    def _fail_all(self, reason: str) -> None:
        job, self.job = self.job, None
        for row in job.rows if job else ():
            self._end(row, reason)
        for slot in range(self.rows):
            self._leave(slot, reason)

