"""Every tiny MoE style other than the Qwen2-MoE that LitServe serves in
tests/serving/test_moe_served.py (Mixtral, Qwen3-MoE, OLMoE; `moe_models.py`) through
int8_grouped -> export -> the causal-LM handler of its archive, which compiles its decode
step as it starts: in this process, no Java; each answer equals the exported folder's
offline greedy text (whose int8_grouped tokens equal the float model's:
test_moe_experts.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ts")

from builders import causal_lm_handler, handler_batch  # noqa: E402
from moe_models import tiny_moe  # noqa: E402

from compress.families.causal_lm.stages.export import export_causal_lm  # noqa: E402
from compress.models.bundle import ModelBundle  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402

PROMPTS = ["the film was", "a much longer prompt about a movie that goes on", "hi"]


@pytest.mark.parametrize("style", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_moe_style_is_exported_compiled_and_answers_its_offline_text(style, tmp_path) -> None:
    model, tokenizer = tiny_moe(style)
    loading.quantize_weights(model, "int8_grouped")
    export_causal_lm(ModelBundle(model, "causal-lm", [], tokenizer=tokenizer,
                                 causal_lm_facts={"scheme": "int8_grouped", "group_size": 32}),
                     tmp_path / "export")
    offline = loading.load_folder(tmp_path / "export")
    want = []
    for prompt in PROMPTS:
        ids = loading.prompt_ids(offline.tokenizer, prompt, chat_template=False)
        out = loading.StaticDecoder(offline.model, 48).generate(
            [ids], 8, loading.stop_ids(offline.model, offline.tokenizer))
        want.append(offline.tokenizer.decode(out.tokens, skip_special_tokens=True))
    assert len(set(want)) == len(PROMPTS)  # the texts vary: the check cannot pass idly

    handler = causal_lm_handler(tmp_path / "export", 1,
                                {"threads": 1, "max_new_tokens": 8, "default_new_tokens": 8,
                                 "cache_len": 48, "compile": "default", "chat_template": False})
    assert [d.compiled for d in handler.decoders.values()] == [True]
    for prompt, text in zip(PROMPTS, want, strict=True):
        data, context, _ = handler_batch([{"prompt": prompt, "stream": False}])
        (answer,) = [json.loads(a) for a in handler.handle(data, context)]
        assert answer["text"] == text, prompt
