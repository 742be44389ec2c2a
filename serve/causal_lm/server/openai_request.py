"""An OpenAI request body as the native request of `requests.py`, and what its answer must
carry (`Wanted`), as OpenAI documents the fields (no torch; shipped in `causal_lm`).

- `null` is "absent" for every optional field.
- Fields that change nothing here are ignored (`IGNORED`); fields that would change the
  output at other than their neutral value, and fields OpenAI does not know, are a 400
  that names them.
- Chat content may be a list of text parts; `developer` messages are system messages;
  `tool` messages and assistant `tool_calls` go through the chat template as text
  (`tools.py`).
- `max_completion_tokens` wins over `max_tokens`.
- `response_format` json_object / json_schema, and tools, constrain the answer
  (`grammar.py`).
- Completions' `prompt` is a string, token ids, or a list of either (each prompt its own
  `n` choices, indexed in order). `echo` with `logprobs` also scores the prompt: each of
  its tokens after the first gets its log-probability and rivals from the prefill (the
  answer comes whole, not streamed); `max_tokens: 0` with `echo` asks for the prompt alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import tools as tool_calls

CHAT, COMPLETIONS = "v1/chat/completions", "v1/completions"
MAX_PROMPTS = 64  # completions: prompts in one request (each its own `n` choices)
# fields that do not change what is generated here
IGNORED = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key",
           "safety_identifier", "stream_options", "parallel_tool_calls"}
# fields that change the output, accepted at their neutral value only
NEUTRAL: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {},
                           "best_of": 1, "modalities": ["text"], "audio": None,
                           "prediction": None, "functions": None, "function_call": None,
                           "reasoning_effort": None, "verbosity": None,
                           "web_search_options": None}
SHARED = {"max_tokens", "temperature", "top_p", "stop", "seed", "ignore_eos", "stream", "n",
          "logprobs"}
SUPPORTED = {CHAT: SHARED | {"messages", "max_completion_tokens", "top_logprobs",
                             "response_format", "tools", "tool_choice"},
             COMPLETIONS: SHARED | {"prompt", "echo", "suffix"}}


@dataclass(frozen=True)
class Wanted:
    """What an OpenAI answer carries beyond its text."""

    include_usage: bool = False  # a stream's last chunk before [DONE]: the usage alone
    logprobs: bool = False  # each token's log-probability (and `top` rivals)
    top: int = 0
    tools: tool_calls.ToolUse | None = None  # the answer is read back as tool calls
    echo: bool = False  # completions: each prompt written before its text (with `logprobs`,
    # its tokens' log-probabilities before the text's)


def native_body(route: str, body: dict[str, Any]) -> tuple[dict[str, Any], Wanted]:
    """(the `requests.py` body of an OpenAI request on `route`, what its answer carries).
    ValueError: a 400 that says which field is wrong and why."""
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - SUPPORTED[route] - IGNORED - set(NEUTRAL))
    if unknown:
        raise ValueError(f"unsupported field {unknown[0]!r}: this server answers "
                         f"{', '.join(sorted(SUPPORTED[route]))}")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] != neutral and not (
                name == "best_of" and body[name] == body.get("n", 1)):
            raise ValueError(f"{name}: only {json.dumps(neutral)} is supported")
    if route == COMPLETIONS and body.get("suffix"):
        raise ValueError("suffix: insertion (fill in the middle) is not supported; send the "
                         "prompt alone")
    native: dict[str, Any] = {}
    if route == CHAT:
        native["messages"], tool_use, schema = _chat(body)
    else:
        native["prompts"], tool_use, schema = _prompts(body), None, None
    new = body.get("max_completion_tokens", body.get("max_tokens"))
    if new is not None:
        native["max_new_tokens"] = new
    native["temperature"] = body.get("temperature", 1.0)  # OpenAI's default: sampling
    for name in ("top_p", "stop", "seed", "ignore_eos", "n"):
        if name in body:
            native[name] = body[name]
    native["stream"] = body.get("stream", False)
    logprobs, top = _logprobs(route, body)
    if logprobs:
        native["logprobs"] = top
    if schema is not None:
        native["json_schema"] = schema
    echo = route == COMPLETIONS and body.get("echo") not in (None, False)
    if echo and body["echo"] is not True:
        raise ValueError("echo: true or false")
    if echo and logprobs and native["stream"]:
        raise ValueError("echo with logprobs is answered whole, not streamed: send "
                         "stream: false")
    if new == 0 and not echo:
        raise ValueError("max_tokens: 0 only with echo: true (the prompt alone, scored "
                         "where logprobs is set)")
    if echo and logprobs:
        native["prompt_logprobs"] = True
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValueError('stream_options: an object such as {"include_usage": true}')
    return native, Wanted(bool(options.get("include_usage")) and native["stream"] is True,
                          logprobs, top, tool_use, echo)


def _logprobs(route: str, body: dict[str, Any]) -> tuple[bool, int]:
    """(whether log-probabilities are asked for, how many rivals a token)."""
    if route == COMPLETIONS:  # an integer: rivals per token
        value = body.get("logprobs")
        if value is None:
            return False, 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"logprobs: an integer from 0 to 20, got {value!r}")
        return True, value
    asked = body.get("logprobs", False)
    if not isinstance(asked, bool):
        raise ValueError(f"logprobs: true or false, got {asked!r}")
    top = body.get("top_logprobs", 0)
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise ValueError(f"top_logprobs: an integer from 0 to 20, got {top!r}")
    if top and not asked:
        raise ValueError("top_logprobs: set logprobs to true as well")
    return asked, top


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The request's prompts, each a string or token ids (OpenAI's legacy `prompt`: a
    string, a list of strings, a list of token ids, or a list of such lists)."""
    if "prompt" not in body:
        raise ValueError("prompt is required")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(is_token_id(i) for i in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(is_token_id(i) for i in p))
            for p in prompt):
        prompts = list(prompt)
    else:
        raise ValueError("prompt: a string, a list of strings, a list of token ids (integers "
                         "from 0), or a list of such lists")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts a request, got "
                         f"{len(prompts)}")
    return prompts


def is_token_id(value: Any) -> bool:
    """An integer from 0 (not a bool): what a prompt of token ids holds."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chat(body: dict[str, Any]) -> tuple[list[dict[str, str]], Any, dict[str, Any] | None]:
    """(the messages as role and text, the tools' use, the schema the answer must meet)."""
    if "messages" not in body:
        raise ValueError("messages is required")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages: a non-empty list of {"role", "content"}')
    plain = [_message(m, k) for k, m in enumerate(messages)]
    tool_use = tool_calls.tool_use(body)
    schema = _response_schema(body.get("response_format"))
    if tool_use is not None:
        if schema is not None:
            raise ValueError("response_format and tools: give one of them (a tool's "
                             "arguments follow its parameters' schema)")
        plain, schema = tool_calls.with_instructions(plain, tool_use), tool_use.schema()
    return plain, tool_use, schema


def _message(message: Any, k: int) -> dict[str, str]:
    """One chat message as {"role", "content": text}."""
    where = f"messages[{k}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f'{where}: an object with a "role" and a "content"')
    role, content = message["role"], message.get("content")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"{where}.role: system, developer, user, assistant or tool, not "
                         f"{role!r}")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ValueError(f'{where}.content: text parts only ({{"type": "text", '
                             f'"text": ...}}); this model reads no images or audio')
        content = "".join(p["text"] for p in content)
    if role == "assistant" and message.get("tool_calls"):
        calls = tool_calls.as_text(message)
        content = f"{content}\n{calls}" if content else calls
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: a string or a list of text parts")
    return {"role": role, "content": content}


def _response_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks the answer to meet (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError('response_format.json_schema: {"name": str, "schema": a JSON '
                             'schema (an object), "strict": bool}')
        return spec.get("schema") or {"type": "object"}
    raise ValueError('response_format: {"type": "text"}, {"type": "json_object"} or '
                     '{"type": "json_schema", "json_schema": {"name", "schema"}}')
