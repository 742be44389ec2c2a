"""How each row of the continuous batch ends (serve/causal_lm/server/batcher.py), on the tiny
varied Llama with uncompiled decoders: at an end token, at max_new_tokens, with an error for its own
prefill alone, with an error for every row when the shared step fails (and the batcher
serves on), when cancelled in any state, or refused when the waiting queue is full. A gate
on the decode step holds the batcher between steps, so each state is reached on purpose."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.server.batcher import ContinuousBatcher, QueueFull, Row, shared_caches
from serve.causal_lm.server.prefill import Prefiller

CACHE = 64


@pytest.fixture(scope="module")
def model(varied_llama_folder):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(varied_llama_folder).eval()


def make_batcher(model, sizes=(1, 2, 4), stop: set[int] | None = None,
                 **options) -> ContinuousBatcher:
    """A batcher of uncompiled decoders (one per bucket), their caches shared, its prefill
    chunks of a fixed size (not sized to the measured step time, which made where rows
    join depend on the machine's load)."""
    decoders = {rows: StaticDecoder(model, CACHE, always_mask=True) for rows in sizes}
    for n, rows in enumerate(sorted(decoders, reverse=True)):
        decoders[rows].generate([[0]] * rows, 2)
        if n == 0:
            shared_caches(decoders)
    return ContinuousBatcher(decoders, Prefiller(model, CACHE, budgeted=False),
                             stop=stop or set(), **options)


def alone(model, ids: list[int], new: int) -> list[int]:
    return StaticDecoder(model, CACHE).generate([ids], new).tokens


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1000, 30000, (length,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


class Collect:
    """A row's tokens and end, as the batcher emits them (every event kept)."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.ends: list[str] = []

    def emit(self, token, end) -> None:
        self.events.put((token, end))

    def wait(self, timeout: float = 30) -> str:
        """The row's end (its tokens taken on the way)."""
        while not self.ends:
            token, end = self.events.get(timeout=timeout)
            self.tokens.append(token) if token is not None else self.ends.append(end)
        return self.ends[0]

    def drain(self) -> None:
        """Take what has arrived (no waiting)."""
        while not self.events.empty():
            token, end = self.events.get_nowait()
            self.tokens.append(token) if token is not None else self.ends.append(end)


class Gate:
    """Holds the batcher's thread before each decode step until `run` lets steps pass."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.cond = threading.Condition()
        self.allowed = self.passed = 0
        self.parked = False
        for decoder in batcher.decoders.values():
            decoder.decode_step = self._held(decoder.decode_step)

    def _held(self, step):
        def run(*args, **kwargs):
            with self.cond:
                self.parked = True
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.passed < self.allowed)
                self.parked, self.passed = False, self.passed + 1
            return step(*args, **kwargs)
        return run

    def run(self, steps: int, timeout: float = 30) -> None:
        """Let `steps` steps pass, then wait until the batcher is held before the next."""
        with self.cond:
            self.allowed = self.passed + steps
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: self.passed == self.allowed and self.parked,
                                      timeout), "the batcher did not reach its next step"

    def open(self) -> None:
        with self.cond:
            self.allowed = 10**9
            self.cond.notify_all()


def submit(batcher, ids: list[int], new: int) -> tuple[Row, Collect]:
    got = Collect()
    return batcher.submit(Row(ids, new, got.emit)), got


def wait_idle(batcher, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while (batcher.busy() or batcher.waiting) and time.time() < deadline:
        time.sleep(0.005)
    assert batcher.busy() == 0 and not batcher.waiting


def test_an_end_token_ends_its_row_and_max_new_tokens_the_other(model) -> None:
    ids = [prompt(5, 1), prompt(7, 2)]
    want, other = alone(model, ids[0], 24), alone(model, ids[1], 24)
    at = next(i for i in range(3, 24) if want[i] not in want[:i] + other)
    batcher = make_batcher(model, stop={want[at]})
    rows = [submit(batcher, i, 24) for i in ids]
    assert [got.wait() for _, got in rows] == ["stop", "length"]
    assert rows[0][1].tokens == want[:at + 1]  # the end token is kept, nothing after it
    assert rows[1][1].tokens == other
    wait_idle(batcher)


def test_a_row_that_ignores_eos_runs_to_its_limit_past_an_end_token(model) -> None:
    ids = prompt(5, 1)
    want = alone(model, ids, 24)
    batcher = make_batcher(model, stop={want[3]})
    got = [Collect(), Collect()]
    batcher.submit(Row(ids, 24, got[0].emit))
    batcher.submit(Row(ids, 24, got[1].emit, ignore_eos=True))
    assert [g.wait() for g in got] == ["stop", "length"]
    assert got[0].tokens == want[:4] and got[1].tokens == want
    wait_idle(batcher)


def test_a_prefill_that_fails_ends_its_own_row_alone(model) -> None:
    bad = prompt(6, 99)
    batcher = make_batcher(model)
    prefill = batcher.prefiller.step

    def failing(job, whole, budget_s=None):
        if any(row.ids == bad for row in job.rows):
            raise RuntimeError("this prompt breaks the model")
        return prefill(job, whole, budget_s)

    batcher.prefiller.step = failing
    gate = Gate(batcher)
    good = [submit(batcher, prompt(4 + i, i), 20) for i in range(2)]
    gate.run(3)  # both decode; then the bad one arrives between steps
    _, broken = submit(batcher, bad, 20)
    later = submit(batcher, prompt(5, 7), 10)
    gate.open()
    assert broken.wait(timeout=10) == ("error: RuntimeError: this prompt breaks the model")
    assert broken.tokens == []
    assert [got.wait() for _, got in good + [later]] == ["length"] * 3
    for row, got in good + [later]:
        assert got.tokens == alone(model, row.ids, row.max_new_tokens)
    wait_idle(batcher)


def test_a_failed_step_ends_every_row_with_an_error_and_the_batcher_serves_on(model) -> None:
    batcher = make_batcher(model)
    gate = Gate(batcher)
    rows = [submit(batcher, prompt(3 + i, 20 + i), 30) for i in range(3)]
    gate.run(2)
    failures = [RuntimeError("the step broke")]  # the next step raises, once
    for decoder in batcher.decoders.values():
        def broken(*args, _held=decoder.decode_step, **kwargs):
            if failures:
                raise failures.pop()
            return _held(*args, **kwargs)
        decoder.decode_step = broken
    gate.open()
    ends = [got.wait() for _, got in rows]
    assert ends == ["error: RuntimeError: the step broke"] * 3
    for row, got in rows:  # the tokens before the failure were right
        assert got.tokens and got.tokens == alone(model, row.ids, 30)[:len(got.tokens)]
    wait_idle(batcher)
    after = [submit(batcher, prompt(4 + i, 40 + i), 12) for i in range(2)]
    assert [got.wait() for _, got in after] == ["length"] * 2
    for row, got in after:
        assert got.tokens == alone(model, row.ids, 12)


def test_cancel_ends_a_row_in_any_state_once_and_frees_its_slot(model) -> None:
    batcher = make_batcher(model, sizes=(1, 2))
    gate = Gate(batcher)
    decoding = [submit(batcher, prompt(4 + i, 50 + i), 40) for i in range(2)]
    gate.run(2)
    waiting = submit(batcher, prompt(5, 60), 10)  # no free slot: it waits
    batcher.cancel(waiting[0])
    assert waiting[1].wait(timeout=5) == "cancelled"  # at once, while the batch decodes
    assert waiting[0] not in batcher.waiting and batcher.busy() == 2

    kept = decoding[1]
    batcher.cancel(decoding[0][0])
    batcher.cancel(decoding[0][0])  # idempotent
    steps = batcher.steps
    gate.run(1)
    assert decoding[0][1].wait(timeout=5) == "cancelled"
    assert batcher.busy() == 1 and batcher.steps <= steps + 1

    # mid-prefill: the row is cancelled while its prompt runs; it never decodes
    started, release = threading.Event(), threading.Event()
    prefill = batcher.prefiller.step

    def slow(job, whole, budget_s=None):
        started.set()
        release.wait(10)
        return prefill(job, whole, budget_s)

    batcher.prefiller.step = slow
    middle = submit(batcher, prompt(6, 61), 10)
    gate.open()
    assert started.wait(10)
    batcher.cancel(middle[0])
    batcher.cancel(kept[0])  # while the batcher is busy with the prefill
    release.set()
    assert middle[1].wait(timeout=10) == "cancelled" and middle[1].tokens == []
    assert kept[1].wait(timeout=10) == "cancelled"
    wait_idle(batcher)
    time.sleep(0.05)  # nothing more arrives for any of them, even cancelled again
    for row, got in (waiting, *decoding, middle, kept):
        batcher.cancel(row)
        got.drain()
        assert got.ends == ["cancelled"], got.ends
    batcher.prefiller.step = prefill
    after = submit(batcher, prompt(5, 62), 8)
    assert after[1].wait() == "length" and after[1].tokens == alone(model, after[0].ids, 8)


def test_every_row_cancelled_leaves_no_busy_row_after_one_step(model) -> None:
    batcher = make_batcher(model)
    gate = Gate(batcher)
    rows = [submit(batcher, prompt(3 + i, 70 + i), 40) for i in range(4)]
    gate.run(3)
    for row, _ in rows:
        batcher.cancel(row)
    steps = batcher.steps
    gate.open()
    wait_idle(batcher)
    assert batcher.steps <= steps + 1
    assert [got.wait(timeout=5) for _, got in rows] == ["cancelled"] * 4


def test_a_full_queue_refuses_a_row_with_a_retry_time(model) -> None:
    batcher = make_batcher(model, sizes=(1,), max_waiting=2)
    gate = Gate(batcher)
    first = submit(batcher, prompt(4, 80), 30)
    gate.run(1)
    queued = [submit(batcher, prompt(4, 81 + i), 5) for i in range(2)]
    with pytest.raises(QueueFull) as refused:
        submit(batcher, prompt(4, 90), 5)
    assert isinstance(refused.value, RuntimeError) and refused.value.retry_after_s >= 1
    assert len(batcher.waiting) == 2
    batcher.cancel(queued[0][0])  # a place frees
    assert queued[0][1].wait(timeout=5) == "cancelled"
    last = submit(batcher, prompt(4, 91), 5)
    gate.open()
    assert [got.wait() for _, got in (first, queued[1], last)] == ["length"] * 3
    assert last[1].tokens == alone(model, last[0].ids, 5)


def test_a_slot_freed_inside_the_bucket_never_poisons_the_next_row(model) -> None:
    """A free slot below the bucket's highest busy one still runs in each step. Once a move
    took the cursor below the start of the row it last held, its old mask opened no
    position: attention over nothing is NaN, written into the cache, and the row placed in
    that slot later read it (0 x NaN) and decoded token 0 from then on. Driven step by step
    on this thread, so every state is reached on purpose."""
    from serve.causal_lm.runtime.attention import attention

    batcher = make_batcher(model, own_thread=False)
    rows: dict[str, tuple[list[int], int, Collect]] = {}

    def submit(name: str, new: int) -> None:
        got = Collect()
        ids = prompt(4, len(rows))
        batcher.submit(Row(ids, new, got.emit))
        rows[name] = (ids, new, got)
        batcher._admit()
        batcher._prefill_chunk()  # a short prompt: one chunk, and it joins

    def step_until(done) -> None:
        while not done():
            batcher._step()

    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        submit("long", 40)  # slot 0 from position 0
        step_until(lambda: batcher.cursor >= 34)
        submit("short", 2)  # slot 1, starting at 30
        submit("late", 20)  # slot 2, starting at 30: the bucket of 4 runs from now on
        step_until(lambda: batcher.slots[0] is None and batcher.slots[1] is None)
        submit("moved", 40)  # no room to its end: every row moves left by 30
        assert batcher.cursor < 30 and batcher.slots[1] is None and batcher.slots[2]
        for _ in range(8):  # the free slot 1 runs; its old row started at 30
            batcher._step()
        assert all(torch.isfinite(layer.values).all() and torch.isfinite(layer.keys).all()
                   for layer in batcher.cache.layers)
        submit("next", 10)  # into the freed slot 1
        assert batcher.slots[1] is not None
        step_until(lambda: not any(batcher.slots))
    for name, (ids, new, got) in rows.items():
        got.wait()
        assert got.tokens == alone(model, ids, new), name
