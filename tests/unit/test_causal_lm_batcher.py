"""Continuous batching (serve/causal_lm/server/batcher.py) on a tiny random Llama: rows that join a
running decode, at any step, with prompts of any lengths, through cursor moves left and right,
decode the tokens each prompt gets alone; cancelled rows free their slots; a seeded sample is the
same as alone."""

from __future__ import annotations

import time

import pytest
import torch
from batcher_checks import (
    Collect,
    alone,
    batcher_of,
    prompt,
    rows_joining_at_any_step_decode_their_tokens_alone,
    varied_model,
)

from serve.causal_lm.runtime.decode import Sampling
from serve.causal_lm.server.batcher import Row


@pytest.fixture(scope="module")
def model():
    return varied_model()


def test_rows_joining_at_any_step_decode_their_tokens_alone(model, monkeypatch) -> None:
    rows_joining_at_any_step_decode_their_tokens_alone(model, monkeypatch)


def test_cancelled_rows_leave_and_a_full_batch_works_after(model) -> None:
    batcher = batcher_of(model)
    gone = [Collect() for _ in range(4)]
    rows = [batcher.submit(Row(prompt(4, i), 40, g.emit)) for i, g in enumerate(gone)]
    gone[0].wait_for(3)
    for row in rows:
        batcher.cancel(row)
    assert [g.wait() for g in gone] == ["cancelled"] * 4
    deadline = time.time() + 10
    while batcher.busy() and time.time() < deadline:
        time.sleep(0.01)
    assert batcher.busy() == 0
    after = [Collect() for _ in range(4)]
    ids = [prompt(6, 10 + i) for i in range(4)]
    for i, g in zip(ids, after, strict=True):
        batcher.submit(Row(i, 10, g.emit))
    assert [g.wait() for g in after] == ["length"] * 4
    assert [g.tokens for g in after] == [alone(model, i, 10) for i in ids]


def test_a_seeded_sample_is_the_same_as_alone(model) -> None:
    batcher = batcher_of(model)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    greedy, sampled = Collect(), Collect()
    batcher.submit(Row(prompt(5, 1), 16, greedy.emit))
    batcher.submit(Row(prompt(4, 2), 16, sampled.emit, sampling))
    assert sampled.wait() == "length" and greedy.wait() == "length"
    assert sampled.tokens == alone(model, prompt(4, 2), 16, sampling)
    assert greedy.tokens == alone(model, prompt(5, 1), 16)


def test_a_request_longer_than_the_cache_is_refused(model) -> None:
    batcher = batcher_of(model, sizes=(1,))
    with pytest.raises(ValueError, match="exceeds the cache"):
        batcher.submit(Row(prompt(40, 0), 30, Collect().emit))


def test_a_top_p_below_float32s_least_picks_the_likeliest_token() -> None:
    """Found by fuzzing the served routes: top_p 1e-300 (0 in float32) kept no token and
    multinomial failed the whole decode."""
    from serve.causal_lm.runtime.decode import pick_tokens

    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(0))
    picked = pick_tokens(logits, [Sampling(10.0, 1e-300, 0), None],
                         [torch.Generator().manual_seed(0), None])
    assert picked.tolist() == logits.argmax(-1).tolist()
