"""Prompt-lookup speculative decoding through Inductor (the unit tier runs it eager,
tests/unit/test_causal_lm_speculative.py): the compiled verifying forward, its window dynamic,
gives the compiled decode step's greedy tokens, drafts kept and refused, limits kept."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import varied_model

from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.runtime.kernels import grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights
from serve.causal_lm.runtime.speculative import SpeculativeDecoder


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


@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped kernel did not build")
@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_a_verification_gives_the_decode_steps_logits_bit_for_bit(scheme) -> None:
    """Grouped weights: the kernels sum every row as a lone row and the verification runs
    the steps' own batch-invariant attention, so a verification of 4 drafts reproduces the
    one-token steps' logits exactly, on every kernel path (it used to differ on AVX2-only
    builds, issue 69's note)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = quantize_weights(LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.1)).eval(), scheme)
    decoder = StaticDecoder(model, 96)
    speculative = SpeculativeDecoder(decoder, k=4)
    prompt = [5, 17, 3, 9, 5, 17]
    with torch.inference_mode(), attention(model, decoder.attention):
        decoder._fresh_cache(1)
        tokens = [int(decoder._forward(torch.tensor([prompt]),
                                       torch.arange(len(prompt))).argmax())]
        steps = []
        for i in range(5):
            logits = decoder.decode_step(torch.tensor([[tokens[-1]]]), len(prompt) + i,
                                         None, None)
            steps.append(logits[0].clone())
            tokens.append(int(logits.argmax()))
        for layer in decoder.cache.layers:
            layer.cumulative_length.fill_(len(prompt))
        verified = speculative._verify(tokens[:5], len(prompt))
    assert torch.equal(verified, torch.stack(steps))
