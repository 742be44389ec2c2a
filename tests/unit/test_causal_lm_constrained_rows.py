"""Rows with a grammar, log-probabilities and shared prompts in the continuous batcher
(grammar.py, picking.py, prefill.py) on a tiny random Llama with SmolLM2's byte-level
tokenizer: constrained answers always validate, greedy and sampled, while the free rows of
the same batch decode the tokens they get alone; each token's log-probability is the
log-softmax of the model's own logits; rows with one prompt are prefilled once."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
import torch
from batcher_checks import Collect, batcher_of

from serve.causal_lm.runtime.decode import Sampling, StaticDecoder
from serve.causal_lm.server import grammar
from serve.causal_lm.server.batcher import Row

jsonschema_rs = pytest.importorskip("jsonschema_rs")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def causal_lm(smol_tokenizer_llama_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smol_tokenizer_llama_folder)
    return model.eval(), AutoTokenizer.from_pretrained(smol_tokenizer_llama_folder)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_constrained_rows_validate_and_free_rows_decode_as_alone(causal_lm) -> None:
    model, tokenizer = causal_lm
    batcher = batcher_of(model)
    batcher.stop = {tokenizer.eos_token_id}
    compiled = grammar.json_grammar(SCHEMA)
    prompts = [ids_of(tokenizer, p) for p in ("a person:", "the film was", "hello there")]
    constrained = [Collect() for _ in range(4)]
    for k, got in enumerate(constrained):
        sampling = Sampling(1.0, 1.0, k) if k else None
        batcher.submit(Row(prompts[0], 56, got.emit, sampling,
                           constraint=grammar.Constraint(tokenizer, compiled)))
    free = [Collect() for _ in prompts[1:]]
    for ids, got in zip(prompts[1:], free, strict=True):
        batcher.submit(Row(ids, 20, got.emit))
    texts = []
    for got in constrained:
        assert got.wait() == "stop"
        texts.append(tokenizer.decode(got.tokens, skip_special_tokens=True))
        jsonschema_rs.validate(SCHEMA, json.loads(texts[-1], parse_float=Decimal))
    assert len(set(texts)) > 1  # sampled rows differ
    for ids, got in zip(prompts[1:], free, strict=True):
        got.wait()
        alone = StaticDecoder(model, 64).generate([ids], 20).tokens
        assert got.tokens == alone[:len(got.tokens)] and len(got.tokens) == 20


def test_logprobs_are_the_models_own_log_softmax(causal_lm) -> None:
    model, tokenizer = causal_lm
    batcher = batcher_of(model)
    ids = ids_of(tokenizer, "the film was")
    got = Collect()
    row = batcher.submit(Row(ids, 8, got.emit, logprobs=3))
    got.wait()
    with torch.no_grad():
        logits = model(torch.tensor([ids + got.tokens])).logits[0, len(ids) - 1:-1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert len(row.token_logprobs) == len(got.tokens) == 8
    for k, (token, (logprob, rivals)) in enumerate(zip(got.tokens, row.token_logprobs,
                                                       strict=True)):
        assert abs(logprob - float(expected[k, token])) < 1e-4
        top = expected[k].topk(3)
        assert [r for r, _ in rivals] == top.indices.tolist()
        assert [v for _, v in rivals] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_rows_with_one_prompt_are_prefilled_once(causal_lm, monkeypatch) -> None:
    model, tokenizer = causal_lm
    batcher = batcher_of(model, own_thread=False)
    prefilled: list[int] = []
    step = batcher.prefiller.step
    monkeypatch.setattr(batcher.prefiller, "step", lambda job, *a, **k: (
        prefilled.append(job.ids.shape[0]), step(job, *a, **k))[1])
    ids = ids_of(tokenizer, "the film was")
    got = [Collect() for _ in range(3)]
    batcher.submit_all([Row(ids, 6, g.emit, Sampling(1.0, 1.0, k))
                        for k, g in enumerate(got)])
    with torch.inference_mode():  # as the batcher's own thread runs
        while not batcher.idle():
            batcher.turn()
    assert prefilled and set(prefilled) == {1}  # one prompt's row for three choices
    tokens = [g.wait() and g.tokens for g in got]
    assert all(len(t) == 6 for t in tokens) and len({tuple(t) for t in tokens}) > 1
    alone = [Collect()]
    batcher.submit(Row(ids, 6, alone[0].emit, Sampling(1.0, 1.0, 1)))
    with torch.inference_mode():
        while not batcher.idle():
            batcher.turn()
    alone[0].wait()
    assert alone[0].tokens == tokens[1]  # the shared prefill is the prompt's own
