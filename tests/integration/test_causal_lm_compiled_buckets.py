"""The causal-LM handler compiles one decode graph per batch bucket as it starts, and every
bucket decodes a full batch to the tokens `generate` gives each prompt alone (in this
process, no Java; Inductor compiles each bucket, so this takes a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ts")

from builders import causal_lm_handler, handler_batch, saved_causal_lm  # noqa: E402

from compress.families.causal_lm.stages.export import export_causal_lm  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402


def _architecture(kind: str, folder: Path) -> Path:
    """A random causal LM saved with MiniLM's tokenizer, shaped so that model dimensions
    equal batch buckets (1, 2, 4): Qwen2 with 2 key-value heads (q/k/v biases, untied
    head); Llama with 4 key-value heads of dimension 4 in 2 layers."""
    import torch
    from conftest import minilm_folder
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    shape = {"vocab_size": tokenizer.vocab_size, "max_position_embeddings": 256,
             "tie_word_embeddings": False, "initializer_range": 0.1}
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, **shape))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_compiled_buckets_each_decode_generates_greedy_tokens(kind, tmp_path) -> None:
    """Every bucket's compiled decoder warms up (where a 2-key-value-head Qwen2 crashed its
    worker: the size-4 bucket ran the size-2 decoder's graph on that decoder's cache) and
    decodes a full batch of its size to the tokens `generate` gives each prompt alone."""
    import torch

    from compress.models.bundle import ModelBundle
    from serve.causal_lm.runtime.loading import load_folder

    lm = load_folder(saved_causal_lm(_architecture(kind, tmp_path / "hf"), tmp_path / "saved"))
    export_causal_lm(ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer,
                                 causal_lm_facts=lm.facts),
                     tmp_path / "export")
    handler = causal_lm_handler(tmp_path / "export", 4,
                                {"threads": 1, "max_new_tokens": 8, "default_new_tokens": 8,
                                 "cache_len": 48, "compile": "default", "chat_template": False})
    assert sorted(handler.decoders) == [1, 2, 4]
    assert all(d.compiled for d in handler.decoders.values())
    prompts = ["the film was", "a much longer prompt about a movie", "hi", "one two three"]
    tokenizer, model = handler.causal_lm.tokenizer, handler.causal_lm.model
    expected = []
    for prompt in prompts:
        ids = torch.tensor([loading.prompt_ids(tokenizer, prompt, chat_template=False)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, pad_token_id=0)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert len(set(expected)) == len(prompts)  # the tokens vary: the check cannot pass idly
    for rows in (1, 2, 4):
        data, context, _ = handler_batch([{"prompt": p, "stream": False} for p in prompts[:rows]])
        answers = [json.loads(a) for a in handler.handle(data, context)]
        assert [a["text"] for a in answers] == expected[:rows], rows
        assert context.get_response_headers(0)["X-Batch-Size"] == str(rows)
