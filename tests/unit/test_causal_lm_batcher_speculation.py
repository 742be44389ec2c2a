"""Speculation inside the continuous batch (serve/causal_lm/server/speculation.py), eager on
the tiny varied Llama: rows whose prompts repeat verify drafts together with rows that find
none, a seeded sample among them; each row's tokens are the tokens it gets alone without
speculation, its refused drafts stay behind as closed positions (holes) that the rows'
moves carry along, and the plan speculates only where the measured step times say it pays."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import Collect, alone, batcher_of, prompt, varied_model

from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.runtime.decode import Sampling
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.speculation import expected_tokens


@pytest.fixture(scope="module")
def model():
    return varied_model()


def repeating(seed: int, phrase: int = 5, times: int = 3) -> list[int]:
    """A random phrase said `times` times and begun again: drafts found from the start."""
    said = torch.randint(1, 97, (phrase,), generator=torch.Generator().manual_seed(seed)).tolist()
    return said * times + said[:2]


def test_expected_tokens_of_a_verification() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def always_speculate(monkeypatch) -> None:
    """The plan verifies the most drafts wherever one is found (what these tests check is
    the verification, whatever a plan would choose on this machine)."""
    monkeypatch.setattr(ContinuousBatcher, "_cost", lambda self, size, k: 1.0 / (1 + k))


def test_rows_verifying_drafts_together_decode_their_alone_tokens(model, monkeypatch) -> None:
    always_speculate(monkeypatch)
    holes: list[int] = []
    leave = ContinuousBatcher._leave
    monkeypatch.setattr(ContinuousBatcher, "_leave", lambda self, slot, reason: (
        holes.append(self.slots[slot].holes if self.slots[slot] else 0),
        leave(self, slot, reason))[1])
    batcher = batcher_of(model, speculate=3)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    cases = [(repeating(1), 24, None), (repeating(2), 20, None), (prompt(6, 3), 18, None),
             (repeating(4), 16, sampling)]
    got = [Collect() for _ in cases]
    for (ids, new, how), collect in zip(cases, got, strict=True):
        batcher.submit(Row(ids, new, collect.emit, how))
    assert [c.wait() for c in got] == ["length"] * len(cases)
    for (ids, new, how), collect in zip(cases, got, strict=True):
        assert collect.tokens == alone(model, ids, new, how), (ids, how)
    assert batcher.verifications > 0 and batcher.accepted > 0
    assert batcher.accepted < batcher.drafted  # drafts both kept and refused
    assert max(holes) > 0  # refused drafts left positions behind
    assert any(k > 0 for _, k in batcher.step_cost)  # verifications were timed


def test_holes_move_with_their_rows_and_stay_closed(model, monkeypatch) -> None:
    """A row decoding with holes in its span while later rows make every row move left
    (the cursor near the cache's end) and right (a prompt longer than the cursor)."""
    always_speculate(monkeypatch)
    moves: list[int] = []
    move = ContinuousBatcher._move
    monkeypatch.setattr(ContinuousBatcher, "_move",
                        lambda self, *a: (moves.append(a[2]), move(self, *a))[1])
    batcher = batcher_of(model, speculate=3, own_thread=False)
    # the second prompt is longer than the cursor (a move right); later rows' rest would
    # run past the cache's end (moves left)
    rows = [(repeating(5), 30), (prompt(30, 9), 12), (repeating(6, 4, 2), 20),
            (prompt(3, 7), 12), (repeating(8), 26), (repeating(10), 20)]
    got: list[list[int]] = []
    ends: list[str] = []

    def turns(until) -> None:
        largest = batcher.decoders[batcher.rows]
        with torch.inference_mode(), attention(largest.model, largest.attention):
            while not until() and not batcher.idle():
                batcher.turn()

    for ids, new in rows:  # each joins once the one before has two tokens
        tokens: list[int] = []
        batcher.submit(Row(ids, new, lambda token, end, tokens=tokens: tokens.append(token)
                           if token is not None else ends.append(end)))
        got.append(tokens)
        turns(lambda tokens=tokens: len(tokens) >= 2)
    turns(lambda: False)
    assert ends == ["length"] * len(rows)
    for (ids, new), tokens in zip(rows, got, strict=True):
        assert tokens == alone(model, ids, new), ids
    assert min(moves) < 0 < max(moves) and batcher.accepted > 0, moves


def test_a_plain_steps_drafts_are_scored_by_the_tokens_after_them(model) -> None:
    """A row that never verifies still learns its acceptance: the drafts found beside its
    plain steps, checked against the tokens those steps gave."""
    batcher = batcher_of(model, speculate=3, own_thread=False)
    batcher.step_cost.update({(1, 0): 0.001, (1, 1): 1.0, (1, 2): 1.0, (1, 3): 1.0})
    collect = Collect()
    ids = repeating(12)
    row = batcher.submit(Row(ids, 24, collect.emit))
    with torch.inference_mode():
        while not batcher.idle():
            batcher.turn()
    assert collect.wait() == "length" and batcher.verifications == 0
    assert row.acceptance is not None and batcher.acceptance != 0.5


def test_speculation_stops_where_a_verification_costs_more_than_it_gives(model) -> None:
    """With verifications measured at 10x a plain step, the plan takes plain steps."""
    batcher = batcher_of(model, speculate=3, own_thread=False)
    collect = Collect()
    row = Row(repeating(11), 8, collect.emit)
    batcher.submit(row)
    for k in range(4):
        batcher.step_cost[1, k] = 0.001 * (10 if k else 1)
    with torch.inference_mode():
        while not batcher.idle():
            batcher.turn()
    assert collect.wait() == "length" and batcher.verifications == 0
    assert collect.tokens == alone(model, repeating(11), 8)
