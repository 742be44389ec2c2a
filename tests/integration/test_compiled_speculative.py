"""Prompt-lookup speculative decoding through Inductor (the unit tier runs it eager,
tests/unit/test_lm_speculative.py): the compiled verifying forward, its window dynamic,
gives the compiled decode step's greedy tokens, drafts kept and refused, limits kept."""

from __future__ import annotations

import torch
from batcher_checks import varied_model

from serve.causal_lm.decode import StaticDecoder
from serve.causal_lm.speculative import SpeculativeDecoder


def test_compiled_speculative_greedy_tokens_equal_the_compiled_decoders() -> None:
    model = varied_model()
    decoder = StaticDecoder(model, 96).compile()
    speculative = SpeculativeDecoder(decoder, k=4).compile()
    generator = torch.Generator().manual_seed(2)
    kept = drafted = 0
    for length in (6, 9, 4):
        phrase = torch.randint(0, 97, (length,), generator=generator).tolist()
        prompt = phrase * 3 + phrase[:2]
        want = decoder.generate([prompt], 48).tokens
        got = speculative.generate(prompt, 48)
        assert got.tokens == want
        assert speculative.generate(prompt, 7).tokens == want[:7]
        kept, drafted = kept + got.accepted, drafted + got.drafted
    assert 0 < kept < drafted
