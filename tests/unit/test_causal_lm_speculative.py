"""Prompt-lookup speculative decoding (serve/causal_lm/runtime/speculative.py), eager on a tiny
random Llama: greedy tokens equal plain decoding's on prompts whose drafts are both kept and
refused, limits and stop tokens end a row where plain decoding ends it, and sampled rows
follow the acceptance rule for point-mass drafts (the tokens keep the target's
distribution). The compiled verifying forward: tests/integration/test_compiled_speculative.py."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import varied_model

from serve.causal_lm.runtime.decode import Sampling, StaticDecoder
from serve.causal_lm.runtime.speculative import (
    SpeculativeDecoder,
    accept_sampled,
    draft_tokens,
    target_probs,
)

CACHE = 96


@pytest.fixture(scope="module")
def model():
    return varied_model()


def repeating_prompts(count: int) -> list[list[int]]:
    """Prompts of a random 6-token phrase said three times and begun a fourth: drafts found
    from the first step."""
    generator = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(count):
        phrase = torch.randint(0, 97, (6,), generator=generator).tolist()
        prompts.append(phrase * 3 + phrase[:2])
    return prompts


def test_drafts_follow_the_latest_longest_match() -> None:
    assert draft_tokens([7, 1, 2, 9, 1, 2, 8, 5, 1, 2], k=2) == [8, 5]  # the latest "1 2"
    assert draft_tokens([4, 2, 3, 5, 1, 3, 6, 2, 3], k=1) == [5]  # "2 3" before "3"
    assert draft_tokens([5, 6, 5, 6], k=5) == [5, 6, 5, 6, 5]  # a cycle goes on
    assert draft_tokens([1, 2, 3], k=3) == []  # nothing recurs
    assert draft_tokens([1, 2, 3, 1], k=2, n_min=2) == []  # too short a match
    assert draft_tokens([1, 2, 3, 1], k=2) == [2, 3]


def test_greedy_tokens_equal_plain_decoding_with_drafts_kept_and_refused(model) -> None:
    plain = StaticDecoder(model, CACHE)
    speculative = SpeculativeDecoder(StaticDecoder(model, CACHE), k=4)
    kept = drafted = verifications = steps = 0
    for prompt in [*repeating_prompts(3), [3, 14, 15, 92, 65, 35]]:
        want = plain.generate([prompt], 32)
        got = speculative.generate(prompt, 32)
        assert got.tokens == want.tokens and got.finish == want.finish == ["length"]
        kept, drafted = kept + got.accepted, drafted + got.drafted
        verifications, steps = verifications + got.verifications, steps + got.plain_steps
    assert 0 < kept < drafted  # drafts were kept and refused
    assert verifications and steps  # verifying forwards and plain steps both ran
    assert verifications + steps < 4 * 31  # fewer forwards than tokens


def test_limits_and_stop_tokens_end_a_row_as_plain_decoding_does(model) -> None:
    plain = StaticDecoder(model, CACHE)
    speculative = SpeculativeDecoder(StaticDecoder(model, CACHE), k=4)
    prompt = repeating_prompts(1)[0]
    full = plain.generate([prompt], 30).tokens
    for limit in (1, 2, 3, 4, 5, 6, 11, 30):  # limits inside a verification's tokens
        got = speculative.generate(prompt, limit)
        assert got.tokens == full[:limit] and got.finish == ["length"]
    for at in (1, 3, 7, 12):  # a stop token first produced at step `at`
        stop = {full[at]}
        want = plain.generate([prompt], 30, stop)
        got = speculative.generate(prompt, 30, stop)
        assert got.tokens == want.tokens == full[:full.index(full[at]) + 1]
        assert got.finish == want.finish == ["stop"]
    with pytest.raises(ValueError, match="exceeds the cache"):
        speculative.generate(prompt, CACHE)


def test_a_cache_near_full_ends_in_plain_steps(model) -> None:
    """Where k + 1 positions no longer fit the cache, the last tokens come one a step."""
    prompt = repeating_prompts(1)[0]
    new = CACHE - len(prompt)
    want = StaticDecoder(model, CACHE).generate([prompt], new).tokens
    got = SpeculativeDecoder(StaticDecoder(model, CACHE), k=4).generate(prompt, new)
    assert got.tokens == want and len(got.tokens) == new


def test_acceptance_rule_keeps_the_target_distribution() -> None:
    """A draft of probability 0.3 is kept 30% of the time; refused, the token is drawn
    from the rest: the first token is distributed as p whatever the draft, and after a kept
    draft the next one as the next row."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    generator = torch.Generator().manual_seed(0)
    trials = 6000
    for draft in (1, 0, 3):  # likely, likelier, impossible
        first = torch.zeros(4)
        second = torch.zeros(4)
        for _ in range(trials):
            out = accept_sampled(p, [draft], generator)
            first[out[0]] += 1
            if len(out) == 2:
                assert out[0] == draft
                second[out[1]] += 1
            else:
                assert len(out) == 1 and out[0] != draft
        assert torch.allclose(first / trials, p[0], atol=0.025), (draft, first / trials)
        kept = second.sum()
        assert abs(kept / trials - p[0, draft]) < 0.025
        if kept > 500:
            assert torch.allclose(second / kept, p[1], atol=0.05)


def test_target_probs_are_the_samplers_top_p_cut() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, 0.65)),
                          torch.tensor([[0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]]))
    assert torch.allclose(target_probs(logits, Sampling(1.0, 1.0)), logits.exp())
    assert target_probs(logits, Sampling(1.0, 1e-9))[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampled_rows_keep_their_limit_seed_and_a_near_zero_temperature_is_greedy(model
                                                                                   ) -> None:
    speculative = SpeculativeDecoder(StaticDecoder(model, CACHE), k=4)
    prompt = repeating_prompts(2)[1]
    greedy = StaticDecoder(model, CACHE).generate([prompt], 24).tokens
    cold = speculative.generate(prompt, 24, sampling=Sampling(1e-6, 1.0, seed=3))
    assert cold.tokens == greedy and cold.verifications and cold.accepted
    warm = [speculative.generate(prompt, 24, sampling=Sampling(1.5, 0.95, seed=s)).tokens
            for s in (5, 5, 6)]
    assert warm[0] == warm[1] and len(warm[0]) == 24 and warm[0] != warm[2]
