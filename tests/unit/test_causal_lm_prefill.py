"""Prefill in the continuous batcher (serve/causal_lm/server/prefill.py, prefix_cache.py): prompts
admitted at one turn are prefilled as one batch, a long one in chunks between the running
rows' decode steps, and the positions a prompt shares with one seen before are copied, not
computed. Each way, every row decodes the tokens its prompt gets alone. The batcher is
driven turn by turn on the test's thread, so each state is reached on purpose."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import CACHE, alone, batcher_of, prompt, varied_model

from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.runtime.static_cache import position_bytes
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.prefill import Prefiller
from serve.causal_lm.server.prefix_cache import MIN_REUSE, PrefixCache


@pytest.fixture(scope="module")
def model():
    return varied_model()


class Rows:
    """Rows submitted to a batcher driven on this thread, with what they got."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.batcher, self.got = batcher, []

    def submit(self, ids: list[int], new: int) -> Row:
        tokens: list[int] = []
        ends: list[str] = []
        row = Row(ids, new, lambda t, e: tokens.append(t) if t is not None
                  else ends.append(e))
        self.got.append((row, tokens, ends))
        return self.batcher.submit(row)

    def run(self, until=None, turns: int = 500) -> None:
        """Turns of the batcher until `until()` (default: idle)."""
        largest = self.batcher.decoders[self.batcher.rows]
        with torch.inference_mode(), attention(largest.model, largest.attention):
            for _ in range(turns):
                if (until or self.batcher.idle)():
                    return
                self.batcher.turn()
        raise AssertionError("the batcher did not get there")

    def check_alone(self, model) -> None:
        for row, tokens, ends in self.got:
            assert ends == ["length"], ends
            assert tokens == alone(model, row.ids, row.max_new_tokens), row.ids


def spy(prefiller: Prefiller, batcher: ContinuousBatcher,
        budgets: list | None = None) -> list[tuple]:
    """Record (rows, positions done before, decode steps so far) of every chunk, and the
    time budget the batcher gave it in `budgets`; chunks of the fixed size (no budget)."""
    seen, step = [], prefiller.step

    def recorded(job, whole, budget_s=None):
        seen.append((len(job.rows), job.done, batcher.steps))
        if budgets is not None:
            budgets.append(budget_s)
        return step(job, whole)

    prefiller.step = recorded
    return seen


def test_prompts_admitted_together_are_prefilled_as_one_batch(model) -> None:
    batcher = batcher_of(model, own_thread=False)
    chunks = spy(batcher.prefiller, batcher)
    rows = Rows(batcher)
    for length, seed in ((3, 1), (9, 2), (5, 3)):
        rows.submit(prompt(length, seed), 10)
    rows.run()
    assert chunks == [(3, 0, 0)]  # one batch, all of it at once (nothing was decoding)
    rows.check_alone(model)


def test_jobs_of_any_size_share_one_prefill_workspace_as_large_as_the_largest(model) -> None:
    batcher = batcher_of(model, own_thread=False)
    chunks = spy(batcher.prefiller, batcher)
    rows = Rows(batcher)
    for batch in ((1,), (2, 3, 4), (5, 6), (7,)):  # jobs of 1, 3, 2 and 1 prompts
        for seed in batch:
            rows.submit(prompt(4 + seed, seed), 6)
        rows.run()
    assert [c[0] for c in chunks] == [1, 3, 2, 1]
    prefiller = batcher.prefiller
    row_bytes = prefiller.cache_len * position_bytes(model)
    assert prefiller.cache_bytes() == 3 * row_bytes  # one workspace of 3 rows, not 1+3+2
    storage = prefiller.workspace.layers[0].keys.untyped_storage().data_ptr()
    assert all(c.layers[0].keys.untyped_storage().data_ptr() == storage
               for c in prefiller.caches.values())
    rows.check_alone(model)  # stale positions of an earlier job change no token


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(model) -> None:
    batcher = batcher_of(model, own_thread=False, chunk=4)
    chunks = spy(batcher.prefiller, batcher)
    rows = Rows(batcher)
    for seed in (1, 2):
        rows.submit(prompt(5, seed), 30)
    rows.run(until=lambda: batcher.busy() == 2)
    rows.submit(prompt(30, 3), 8)
    rows.run()
    long = [c for c in chunks if c[0] == 1]
    assert len(long) == 30 // 4 + 1  # 4 positions a chunk, while two rows decode
    steps = [c[2] for c in long]
    assert steps == sorted(set(steps)), "a decode step runs between two chunks"
    assert [c[1] for c in long] == list(range(0, 30, 4))
    rows.check_alone(model)


def test_a_chunk_beside_running_rows_takes_about_one_decode_steps_time(model) -> None:
    batcher = batcher_of(model, own_thread=False, chunk=16)
    prefiller, budgets = batcher.prefiller, []
    chunks = spy(prefiller, batcher, budgets)
    rows = Rows(batcher)
    rows.submit(prompt(5, 1), 30)
    rows.run(until=lambda: batcher.busy() == 1)
    rows.submit(prompt(30, 3), 8)
    rows.run()
    assert len(chunks) == len(budgets) >= 2
    assert budgets[0] is None or budgets[0] > 0  # the first row: nothing was decoding
    assert all(b is not None and b > 0 for b in budgets[1:])  # the decode step's time
    rows.check_alone(model)
    # positions a chunk: as many as fit the budget, from the time a position of as many
    # rows took (8 before any chunk of that many rows ran)
    assert prefiller.position_s[1] > 0
    prefiller.position_s = {2: 0.001}
    assert prefiller.chunk_for(2, 0.01) == 5
    assert prefiller.chunk_for(2, 0.0001) == 2  # at least 2
    assert prefiller.chunk_for(2, 10.0) == 16  # at most `chunk`
    assert prefiller.chunk_for(2, None) == 16
    assert prefiller.chunk_for(3, 0.01) == 8  # not measured yet
    prefiller.budgeted = False  # fixed chunks
    assert prefiller.chunk_for(2, 0.01) == 16


def test_a_batch_whose_prefill_fails_goes_again_row_by_row(model) -> None:
    batcher = batcher_of(model, own_thread=False)
    bad = prompt(6, 9)
    step = batcher.prefiller.step

    def failing(job, whole, budget_s=None):
        if any(r.ids == bad for r in job.rows):
            raise RuntimeError("this prompt breaks the model")
        return step(job, whole, budget_s)

    batcher.prefiller.step = failing
    rows = Rows(batcher)
    good = [rows.submit(prompt(4 + i, i), 6) for i in range(2)]
    rows.submit(bad, 6)
    rows.run()
    ends = {id(row): e for row, _, e in rows.got}
    assert ends[id(rows.got[2][0])] == ["error: RuntimeError: this prompt breaks the model"]
    for row, tokens, end in rows.got[:2]:
        assert row in good and end == ["length"]
        assert tokens == alone(model, row.ids, 6)


def test_a_shared_prefix_is_copied_not_computed_and_decodes_the_same_tokens(model) -> None:
    cache = PrefixCache(4 * CACHE * position_bytes(model))
    batcher = batcher_of(model, own_thread=False, prefix_cache=cache)
    computed: list[int] = []
    run = batcher.prefiller.run
    batcher.prefiller.run = lambda m, c, ids, *a: (computed.append(ids.shape[1]),
                                                   run(m, c, ids, *a))[1]
    shared = prompt(20, 5)
    first, second = shared + [3, 4, 5], shared + [6, 7]
    rows = Rows(batcher)
    rows.submit(first, 8)
    rows.run()
    rows.submit(second, 8)
    rows.run()
    assert computed == [len(first), len(second) - len(shared)]
    held = (len(first) + len(second)) * position_bytes(model)
    assert cache.stats() | {"entries": 0} == {"entries": 0, "tokens": len(first) + len(second),
                                              "bytes": held, "max_bytes": cache.max_bytes,
                                              "hits": 1, "misses": 1, "reused_tokens": 20}
    rows.check_alone(model)  # the copied positions give the tokens a full prefill gives


def test_the_prefix_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    def kv(ids):
        values = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(2, -1, 3)
        return [values.clone(), values + 1], [values - 1, values * 2]

    position = 4 * 2 * 3 * 4  # bytes: 4 tensors of 2 x 3 float32 a position
    cache = PrefixCache(max_bytes=30 * position)
    prompts = [[k] * 12 for k in (1, 2, 3)]
    for ids in prompts[:2]:
        cache.store(ids, *kv(ids))
    assert cache.lookup(prompts[0] + [9]).length == 12  # the first is now the most recent
    cache.store(prompts[2], *kv(prompts[2]))  # 36 > 30: the least recent (the second) goes
    assert cache.tokens == 24 and cache.lookup(prompts[1] + [9]) is None
    assert cache.bytes == 24 * position
    hit = cache.lookup(prompts[2][:10] + [7, 7])
    keys, _ = kv(prompts[2])
    assert hit.length == 10
    assert all(torch.equal(h, k[:, :10]) for h, k in zip(hit.keys, keys, strict=True))
    assert cache.lookup(prompts[0]).length == 11  # never the last token: its logits are needed
    assert cache.lookup([1] * (MIN_REUSE - 1) + [5]) is None  # too short to be worth a copy
    longer = prompts[0] + [4] * 5
    cache.store(longer, *kv(longer))  # it extends the first, which it replaces
    assert sorted(len(k) for k in cache.entries) == [12, 17] and cache.tokens == 29
    assert cache.bytes == 29 * position <= cache.max_bytes
    cache.store([5] * 31, *kv([5] * 31))  # larger than the whole bound: not kept
    assert cache.lookup([5] * 31 + [1]) is None and cache.bytes == 29 * position
