"""Which waiting row the continuous batch admits (serve/causal_lm/server/batcher.py): the first
that fits, so a small request does not wait behind a large one while a slot is free; and the oldest
once it has waited `patience` steps, so a large one is not starved by a stream of small
ones. Each prompt's tokens are the ones it gets alone."""

from __future__ import annotations

from test_causal_lm_batcher_rows import Gate, alone, make_batcher, model, prompt, submit  # noqa: F401


def test_a_small_request_passes_a_large_one_that_does_not_fit_yet(model) -> None:  # noqa: F811
    batcher = make_batcher(model)
    gate = Gate(batcher)
    running = submit(batcher, prompt(4, 1), 50)
    gate.run(3)
    # 30 + 30 fits the cache of 64 alone, not beside a row with 46 tokens to go
    large = submit(batcher, prompt(30, 2), 30)
    small = submit(batcher, prompt(3, 3), 5)
    gate.run(1)
    small[1].drain()
    large[1].drain()
    assert len(small[1].tokens) >= 1 and large[1].tokens == []
    assert list(batcher.waiting) == [large[0]]
    gate.open()
    assert [got.wait() for _, got in (running, large, small)] == ["length"] * 3
    for row, got in (running, large, small):
        assert got.tokens == alone(model, row.ids, row.max_new_tokens)


def test_a_large_request_is_admitted_under_a_stream_of_small_ones(model) -> None:  # noqa: F811
    """Small rows arrive every 4 steps, each with 24 tokens to go: the large one fits only
    where every row is within 14 tokens of its end, which such a stream never leaves."""
    patience = 8
    batcher = make_batcher(model, sizes=(1, 2, 4, 8), patience=patience)
    gate = Gate(batcher)
    small: list = []
    for _ in range(3):
        small.append(submit(batcher, prompt(3, 100 + len(small)), 24))
        gate.run(4)
    large = submit(batcher, prompt(50, 11), 14)
    waited, passed = 0, 0
    while True:
        for _, got in (large, *small):
            got.drain()
        if large[1].tokens:
            break
        passed = sum(bool(got.tokens) for _, got in small[3:])
        if waited % 4 == 0:
            small.append(submit(batcher, prompt(3, 100 + len(small)), 24))
        gate.run(1)
        waited += 1
        assert waited < 150, "the large request was starved"
    # small rows went past it at first; then it waited at most for the rows in flight
    assert passed >= 2 and waited <= patience + 24, (passed, waited)
    gate.open()
    for row, got in (large, *small):
        assert got.wait() == "length"
        assert got.tokens == alone(model, row.ids, row.max_new_tokens), row.ids
