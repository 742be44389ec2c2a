"""Structured output and tools through the continuous-batching handler, in this process, on a
tiny random Llama with SmolLM2's byte-level tokenizer (what llguidance reads): a request's
JSON schema is compiled once for its n choices (and once for every request that repeats it,
refused or not), off the thread that parses plain prompts; a schema past the archive's
bound is a 400, and it counts in the prompt's characters; a malformed tool request is a 400
in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from decimal import Decimal
from typing import Any

import pytest

pytest.importorskip("ts")
llguidance = pytest.importorskip("llguidance")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

from builders import causal_lm_handler, handler_batch, saved_causal_lm  # noqa: E402
from ts.context import RequestProcessor  # noqa: E402

from serve.causal_lm.runtime import loading  # noqa: E402
from serve.causal_lm.server import grammar  # noqa: E402
from serve.causal_lm.server.handler import CausalLMHandler  # noqa: E402

CHAT = "v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
MAX_SCHEMA_CHARS = 4000


@pytest.fixture(scope="module")
def handler(smol_tokenizer_llama_folder, tmp_path_factory) -> CausalLMHandler:
    from compress.families.causal_lm.stages.export import export_causal_lm
    from compress.models.bundle import ModelBundle

    out = tmp_path_factory.mktemp("lm_export") / "transformers"
    saved = saved_causal_lm(smol_tokenizer_llama_folder, tmp_path_factory.mktemp("saved"))
    lm = loading.load_folder(saved)
    export_causal_lm(ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer,
                                 causal_lm_facts=lm.facts), out)
    settings = {"threads": 1, "rows": 8, "max_new_tokens": 64, "default_new_tokens": 6,
                "cache_len": 128, "compile": "none", "chat_template": False,
                "max_schema_chars": MAX_SCHEMA_CHARS}
    return causal_lm_handler(out, 1, settings, asyncCommunication=True)


def batch(bodies: list[dict], paths: list[str | None]):
    """(data, context, chunk times): each streamed chunk's arrival time kept per request."""
    data, context, _ = handler_batch(bodies)
    seen: dict[int, list[float]] = {i: [] for i in range(len(bodies))}
    context.send_chunk = lambda i, chunk: seen[i].append(time.perf_counter())
    for i, path in enumerate(paths):
        if path:
            context.request_processor[i] = RequestProcessor({"url_path": path})
    return data, context, seen


def run(handler: CausalLMHandler, bodies: list[dict], paths: list[str | None]
        ) -> tuple[list[Any], Any, dict[int, list[float]]]:
    data, context, seen = batch(bodies, paths)
    answers = asyncio.run(asyncio.wait_for(handler.handle(data, context), 120))
    return [a if a.startswith("data:") else json.loads(a) for a in answers], context, seen


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "the film was"}], "temperature": 0,
            **fields}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def wide(branches: int, tag: str = "k") -> dict[str, Any]:
    """An anyOf of one-key objects: its text grows with `branches`."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}},
                       "required": [f"{tag}{i}"], "additionalProperties": False}
                      for i in range(branches)]}


class Counting:
    """llguidance's LLMatcher, its matchers and schema compilations counted."""

    def __init__(self) -> None:
        self.real, self.matchers, self.schemas = llguidance.LLMatcher, 0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.matchers += 1
        return self.real(*args, **kwargs)

    def grammar_from_json_schema(self, *args: Any, **kwargs: Any) -> str:
        self.schemas += 1
        return self.real.grammar_from_json_schema(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    counted = Counting()
    monkeypatch.setattr(llguidance, "LLMatcher", counted)
    return counted


def test_a_schema_is_compiled_once_for_its_n_choices_and_its_repeats(handler,
                                                                     counting) -> None:
    schema = {**SCHEMA, "title": "once"}  # a text no other test sends
    body = chat(n=8, max_tokens=24, temperature=1.0, seed=3,
                response_format=response_format(schema))
    answers, context, _ = run(handler, [body], [CHAT])
    assert context.get_response_status(0)[0] == 200, answers
    texts = [c["message"]["content"] for c in answers[0]["choices"]]
    assert len(texts) == 8
    for text in texts:
        jsonschema_rs.validate(schema, json.loads(text, parse_float=Decimal))
    assert (counting.schemas, counting.matchers) == (1, 1)
    answers, context, _ = run(handler, [body, body], [CHAT, CHAT])
    assert [context.get_response_status(i)[0] for i in (0, 1)] == [200, 200]
    assert (counting.schemas, counting.matchers) == (1, 1)  # the compiled one, copied


def test_a_refused_schema_is_refused_once(handler, counting) -> None:
    refused = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    body = chat(max_tokens=4, response_format=response_format(refused))
    first, context, _ = run(handler, [body], [CHAT])
    assert context.get_response_status(0)[0] == 400
    assert first[0]["error"]["message"].startswith("the JSON schema cannot be used")
    again, context, _ = run(handler, [body], [CHAT])
    assert context.get_response_status(0)[0] == 400 and again == first
    assert counting.schemas == 1


def test_a_plain_prompt_flows_while_a_schema_compiles(handler, monkeypatch) -> None:
    """A schema whose compilation takes 3 s, sent first: a plain chat request's first token
    comes long before that (it came after 4.7 s when one thread parsed both)."""
    compile_grammar = grammar.json_grammar

    def slow(schema: dict[str, Any]) -> str:
        time.sleep(3.0)
        return compile_grammar(schema)

    monkeypatch.setattr(grammar, "json_grammar", slow)
    began = time.perf_counter()
    answers, context, seen = run(handler, [
        chat(max_tokens=4, response_format=response_format({**SCHEMA, "title": "slow"})),
        chat(max_tokens=4, stream=True)], [CHAT, CHAT])
    assert [context.get_response_status(i)[0] for i in (0, 1)] == [200, 200], answers
    first_token_s = seen[1][0] - began
    assert first_token_s < 1.5, f"the plain request's first chunk came at {first_token_s:.2f} s"


def test_a_schema_past_the_bound_is_a_400_that_names_it(handler) -> None:
    schema = wide(120)
    assert len(json.dumps(schema)) > MAX_SCHEMA_CHARS
    answers, context, _ = run(handler, [
        chat(max_tokens=4, response_format=response_format(schema)),
        {"prompt": "the film was", "json_schema": schema, "max_new_tokens": 4},
        chat(max_tokens=4, response_format=response_format(wide(20)))],
        [CHAT, None, CHAT])
    assert [context.get_response_status(i)[0] for i in range(3)] == [400, 400, 200], answers
    assert f"at most {MAX_SCHEMA_CHARS} characters" in answers[0]["error"]["message"]
    assert f"at most {MAX_SCHEMA_CHARS} characters" in answers[1]["error"]


def test_a_schema_counts_in_the_prompts_characters(handler) -> None:
    """A prompt that alone fits the characters' bound, with a schema that takes it past."""
    bound = handler.limits.max_prompt_chars
    assert bound > 0
    schema = wide(10)
    prompt = "x" * (bound - len(json.dumps(schema)) // 2)
    answers, context, _ = run(handler, [
        {"prompt": prompt, "json_schema": schema, "max_new_tokens": 4}], [None])
    assert context.get_response_status(0)[0] == 400
    assert answers[0]["error"].startswith(f"prompt too long: {len(prompt)} characters and a "
                                          f"JSON schema of {len(json.dumps(schema))}")


NESTED: dict[str, Any] = {"type": "object"}
for _ in range(400):  # 800 levels of JSON: Python's json reads it, a recursive walk fails
    NESTED = {"anyOf": [NESTED]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
MALFORMED = {
    "tool_choice function 7": {"tools": [TOOL], "tool_choice": {"type": "function",
                                                                "function": 7}},
    "tool_choice a list": {"tools": [TOOL], "tool_choice": ["f"]},
    "a deeply nested tool schema": {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": NESTED}}]},
    "a deeply nested response schema": {"response_format": response_format(NESTED)},
    "tool_calls 7": {"messages": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "", "tool_calls": 7}]},
    "a tool call 7": {"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "", "tool_calls": [7]}]},
    "a call's function 7": {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": 7}]}]},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_tool_request_is_an_openai_400(handler, case) -> None:
    answers, context, _ = run(handler, [chat(max_tokens=4, **MALFORMED[case])], [CHAT])
    assert context.get_response_status(0)[0] == 400, answers
    error = answers[0]["error"]
    assert set(answers[0]) == {"error"} and isinstance(error, dict), answers
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert "\n" not in error["message"] and {"param", "code"} <= set(error)


def test_schemas_past_the_compile_bound_get_a_503_and_compile_at_the_lowest_priority(
        handler, monkeypatch) -> None:
    """Four new schemas sent at once, each taking 1.5 s to compile, beside a schema compiled
    before and a plain request: two wait for the compiling thread (max_schema_waiting), the
    other two get a 503 with Retry-After at once; the compiled schema and the plain prompt
    pass the bound. The compiling thread runs at nice 19. (Before: all six waited, every
    new schema held a row of the batcher's queue while it did, at the decode's priority.)"""
    compile_grammar, niceness = grammar.json_grammar, []

    def slow(schema: dict[str, Any]) -> str:
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(1.5)
        return compile_grammar(schema)

    compiled = {**SCHEMA, "title": "compiled before"}
    assert run(handler, [chat(max_tokens=2, response_format=response_format(compiled))],
               [CHAT])[1].get_response_status(0)[0] == 200
    monkeypatch.setattr(grammar, "json_grammar", slow)
    assert handler.compiling.bound == 2  # the default of HandlerSettings.max_schema_waiting
    news = [chat(max_tokens=2, response_format=response_format({**SCHEMA, "title": f"new {k}"}))
            for k in range(4)]
    answers, context, _ = run(handler, [*news, chat(max_tokens=2, response_format=
                                                    response_format(compiled)),
                                        chat(max_tokens=2)], [CHAT] * 6)
    statuses = [context.get_response_status(i)[0] for i in range(6)]
    assert statuses == [200, 200, 503, 503, 200, 200], answers
    for refused in answers[2:4]:
        assert "2 JSON schemas are compiling: try again in" in refused["error"]["message"]
    assert int(context.get_response_headers(2)["Retry-After"]) >= 1
    assert niceness == [19, 19]
