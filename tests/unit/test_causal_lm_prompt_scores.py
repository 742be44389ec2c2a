"""A prompt's own log-probabilities from the continuous batcher's prefill (OpenAI's echo with
logprobs, what lm-eval's likelihood tasks read): each prompt token after the first gets the
log-probability the model gives it after the tokens before it, and its likeliest rivals,
equal to an offline log-softmax of the whole prompt's forward; computed in chunks beside
rows that decode, never read from the prefix cache, and a row that asks for no new token
ends after its prefill. The batcher is driven turn by turn on the test's thread."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import CACHE, alone, batcher_of, prompt, varied_model

from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.runtime.static_cache import position_bytes
from serve.causal_lm.server import prefill
from serve.causal_lm.server.batcher import Row
from serve.causal_lm.server.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def model():
    return varied_model()


def offline(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the whole prompt's logits, each position's (positions - 1 x vocab)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def drive(batcher, until, turns: int = 400) -> None:
    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        for _ in range(turns):
            if until():
                return
            batcher.turn()
    raise AssertionError("the batcher did not get there")


def submitted(batcher, ids: list[int], new: int, score: bool = False, rivals: int = 0):
    tokens: list[int] = []
    ends: list[str] = []
    row = Row(ids, new, lambda t, e: tokens.append(t) if t is not None else ends.append(e),
              logprobs=rivals if score else None, score_prompt=score)
    batcher.submit(row)
    return row, tokens, ends


def test_prompt_scores_equal_an_offline_log_softmax_in_chunks_beside_decoding_rows(
        model, monkeypatch) -> None:
    monkeypatch.setattr(prefill, "SCORED_CHUNK", 8)  # several chunks a prompt
    cache = PrefixCache(4 * CACHE * position_bytes(model))
    batcher = batcher_of(model, own_thread=False, prefix_cache=cache)
    shared = prompt(30, 7)
    first = submitted(batcher, shared, 20)  # decodes while the others are scored; and its
    drive(batcher, lambda: len(first[1]) >= 2)  # prompt is in the prefix cache by now
    scored = [submitted(batcher, shared + [5, 9], 4, score=True, rivals=3),
              submitted(batcher, prompt(41, 8), 0, score=True, rivals=0),
              submitted(batcher, prompt(5, 9), 1, score=True, rivals=2)]
    drive(batcher, batcher.idle)
    assert first[2] == ["length"] and first[1] == alone(model, shared, 20)
    for row, tokens, ends in scored:
        want = offline(model, row.ids)
        got = row.prompt_logprobs
        assert len(got) == len(row.ids) - 1
        assert [lp for lp, _ in got] == pytest.approx(
            [float(want[k, t]) for k, t in enumerate(row.ids[1:])], abs=1e-4)
        for k, (_, rivals) in enumerate(got):
            top = want[k].topk(row.logprobs or 1)
            assert len(rivals) == (row.logprobs or 0)
            if rivals:
                assert [r for r, _ in rivals] == top.indices.tolist()
                assert [v for _, v in rivals] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert ends == ["length"]
        assert tokens == (alone(model, row.ids, row.max_new_tokens)
                          if row.max_new_tokens else [])  # none where none were asked


def test_a_scored_prompt_is_computed_whole_not_read_from_the_prefix_cache(model) -> None:
    cache = PrefixCache(4 * CACHE * position_bytes(model))
    batcher = batcher_of(model, own_thread=False, prefix_cache=cache)
    ids = prompt(24, 3)
    submitted(batcher, ids, 2)
    drive(batcher, batcher.idle)
    done_before: list[int] = []
    start = batcher.prefiller.start

    def recorded(rows):
        job = start(rows)
        done_before.append(job.done)
        return job

    batcher.prefiller.start = recorded
    plain = submitted(batcher, ids + [4], 2)
    drive(batcher, batcher.idle)
    scored = submitted(batcher, ids + [4], 2, score=True)
    drive(batcher, batcher.idle)
    assert done_before[0] > 0 and done_before[1] == 0  # the plain one reused the prefix
    assert scored[1] == plain[1] and len(scored[0].prompt_logprobs) == len(ids)
