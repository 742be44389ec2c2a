"""OpenAI request bodies as the native requests of serve/causal_lm (openai_request.py,
tools.py): null is absent, text parts, max_completion_tokens over max_tokens, the usage
chunk only when asked, fields that change the output refused by name, response_format and
tools as a JSON schema the answer must meet, and tool-call answers read back."""

from __future__ import annotations

import json

import pytest

from serve.causal_lm.server import tools as tool_calls
from serve.causal_lm.server.openai_request import CHAT, COMPLETIONS, native_body

ASK = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_null_fields_are_absent_and_max_completion_tokens_wins() -> None:
    native, wanted = native_body(CHAT, {
        "messages": ASK, "logprobs": False, "response_format": {"type": "text"},
        "temperature": None, "stream": None, "max_completion_tokens": None, "max_tokens": 5,
        "user": "u", "metadata": {"a": "b"}, "store": False, "tools": None, "n": None})
    assert native == {"messages": ASK, "max_new_tokens": 5, "temperature": 1.0,
                      "stream": False}
    assert not wanted.logprobs and not wanted.include_usage and wanted.tools is None
    native, _ = native_body(CHAT, {"messages": ASK, "max_tokens": 5,
                                   "max_completion_tokens": 9})
    assert native["max_new_tokens"] == 9


def test_text_parts_developer_and_tool_messages_become_plain_chat() -> None:
    native, _ = native_body(CHAT, {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                          {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]})
    assert native["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": json.dumps(
            {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]})},
        {"role": "tool", "content": "rain"}]
    with pytest.raises(ValueError, match="text parts only"):
        native_body(CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})


@pytest.mark.parametrize("body, named", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"mirostat": 2}, "mirostat"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "nope"}}}, "tool_choice"),
])
def test_what_would_change_the_output_is_refused_by_name(body: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        native_body(CHAT, {"messages": ASK, **body})


def test_completions_echo_logprobs_and_a_refused_suffix() -> None:
    native, wanted = native_body(COMPLETIONS, {"prompt": ["the film"], "echo": True,
                                               "stream": True})
    assert native["prompts"] == ["the film"] and wanted.echo
    assert "prompt_logprobs" not in native
    native, wanted = native_body(COMPLETIONS, {"prompt": "x", "logprobs": 3})
    assert native["logprobs"] == 3 and wanted.logprobs and wanted.top == 3
    assert not wanted.echo and "prompt_logprobs" not in native
    with pytest.raises(ValueError, match="suffix"):
        native_body(COMPLETIONS, {"prompt": "x", "suffix": "y"})
    native, wanted = native_body(COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1,
                                               "max_tokens": 0})
    assert native["prompt_logprobs"] and native["max_new_tokens"] == 0 and wanted.echo
    with pytest.raises(ValueError, match="stream: false"):  # scored prompts come whole
        native_body(COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    with pytest.raises(ValueError, match="max_tokens: 0 only with echo"):
        native_body(COMPLETIONS, {"prompt": "x", "max_tokens": 0})


@pytest.mark.parametrize("prompt, prompts", [
    ("a", ["a"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6, 7], [[5, 6, 7]]),  # token ids: one prompt
    ([[5, 6], [7]], [[5, 6], [7]]),  # lm-eval's batches
    (["a", [7]], ["a", [7]]),
])
def test_completions_prompts_are_strings_or_token_ids_one_or_many(prompt, prompts) -> None:
    assert native_body(COMPLETIONS, {"prompt": prompt})[0]["prompts"] == prompts


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [-1], [True], [[1], 2], {"a": 1},
                                    ["a"] * 65])
def test_a_prompt_of_no_known_shape_is_refused(prompt) -> None:
    with pytest.raises(ValueError, match="prompt"):
        native_body(COMPLETIONS, {"prompt": prompt})


def test_usage_chunk_only_when_asked_and_only_on_streams() -> None:
    assert native_body(CHAT, {"messages": ASK, "stream": True, "stream_options": {
        "include_usage": True}})[1].include_usage
    assert not native_body(CHAT, {"messages": ASK, "stream": True})[1].include_usage
    assert not native_body(CHAT, {"messages": ASK, "stream_options": {
        "include_usage": True}})[1].include_usage


def test_response_format_and_tools_become_the_answers_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    native, _ = native_body(CHAT, {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert native["json_schema"] == schema
    native, _ = native_body(CHAT, {"messages": ASK, "response_format": {"type": "json_object"}})
    assert native["json_schema"] == {"type": "object"}
    native, wanted = native_body(CHAT, {"messages": ASK, "tools": [WEATHER, TIME],
                                        "tool_choice": "required",
                                        "parallel_tool_calls": False})
    calls = native["json_schema"]["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and len(calls["items"]["anyOf"]) == 2
    assert native["messages"][0]["role"] == "system"
    assert "get_weather" in native["messages"][0]["content"]
    assert wanted.tools is not None and wanted.tools.mode == "required"
    native, wanted = native_body(CHAT, {"messages": ASK, "tools": [WEATHER]})
    assert wanted.tools.mode == "auto" and "anyOf" in native["json_schema"]
    native, wanted = native_body(CHAT, {"messages": ASK, "tools": [WEATHER],
                                        "tool_choice": "none"})
    assert wanted.tools is None and "json_schema" not in native
    assert native["messages"] == ASK


def test_tool_call_answers_are_read_back_as_openai_tool_calls() -> None:
    calls, text = tool_calls.called('{"tool_calls": [{"name": "get_weather", '
                                    '"arguments": {"city": "Oslo"}}]}')
    assert text == "" and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_")
    assert tool_calls.called('{"response": "It rains."}') == (None, "It rains.")
    assert tool_calls.called('{"tool_calls": [{"na') == (None, '{"tool_calls": [{"na')
