"""OpenAI's API for a served causal LM (shipped beside `handler.py`; no torch, no compress):
the routes `v1/chat/completions`, `v1/completions` and `v1/models` under the model's
prediction URL, so that the `openai` client reaches it with
`base_url=http://HOST:PORT/predictions/MODEL/VERSION/v1` and the inference token as its key.

A request body becomes the native request of `requests.py` (`native_body`); answers are
OpenAI's objects, streamed as server-sent events (`data: {chunk}` lines, the last chunk with
`finish_reason` and `usage`, then `data: [DONE]`); errors are OpenAI error objects.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

CHAT, COMPLETIONS, MODELS = "v1/chat/completions", "v1/completions", "v1/models"
ROUTES = (CHAT, COMPLETIONS, MODELS)
STREAM_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"
# fields OpenAI's clients send that change nothing here at their default values
NEUTRAL = {"model": None, "n": 1, "frequency_penalty": 0, "presence_penalty": 0,
           "logprobs": None, "user": None, "stream_options": None, "echo": False,
           "best_of": 1, "suffix": None, "parallel_tool_calls": None}


class RouteError(LookupError):
    """A path under the model's URL that is not one of ROUTES (answered 404)."""


def route_of(url_path: str | None) -> str | None:
    """The OpenAI route of a request's `url_path` header, None for the native API."""
    path = (url_path or "").strip("/")
    if not path:
        return None
    if path not in ROUTES:
        raise RouteError(f"unknown path {path!r}: this model answers {', '.join(ROUTES)}")
    return path


def native_body(route: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the `requests.py` body of an OpenAI request, whether usage goes in its stream).
    Unsupported options raise ValueError (a 400)."""
    known = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
             "top_p", "stop", "seed", "ignore_eos", "stream", *NEUTRAL}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unsupported field {unknown[0]!r}")
    for name, neutral in NEUTRAL.items():
        if name not in ("model", "user", "stream_options") and body.get(name) not in (
                None, neutral):
            raise ValueError(f"{name}: only {neutral!r} is supported")
    text = "messages" if route == CHAT else "prompt"
    if text not in body:
        raise ValueError(f"{text} is required")
    native: dict[str, Any] = {text: body[text]}
    if route == COMPLETIONS and isinstance(body[text], list) and len(body[text]) == 1:
        native[text] = body[text][0]  # a list of one prompt
    new = body.get("max_completion_tokens", body.get("max_tokens"))
    if new is not None:
        native["max_new_tokens"] = new
    native["temperature"] = body.get("temperature", 1.0)  # OpenAI's default: sampling
    for name in ("top_p", "stop", "seed", "ignore_eos"):
        if body.get(name) is not None:
            native[name] = body[name]
    native["stream"] = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValueError("stream_options: an object")
    return native, bool(options.get("include_usage", True))


class Answer:
    """The OpenAI objects of one completion: chunks as the text grows, then the end."""

    def __init__(self, route: str, model: str):
        self.route, self.model = route, model
        self.id = ("chatcmpl-" if route == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.started = False

    def _base(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, piece: str) -> str:
        """One server-sent event carrying `piece` of the text."""
        if self.route == CHAT:
            delta = {"content": piece} | ({} if self.started else {"role": "assistant"})
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            body = self._base("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": None, "logprobs": None}
            body = self._base("text_completion") | {"choices": [choice]}
        self.started = True
        return event(body)

    def last_chunk(self, finish: str, usage: dict[str, int] | None) -> str:
        """The final event (empty text, `finish_reason`, `usage`) and `[DONE]`."""
        if self.route == CHAT:
            choice = {"index": 0, "delta": {}, "finish_reason": finish}
            body = self._base("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": "", "finish_reason": finish, "logprobs": None}
            body = self._base("text_completion") | {"choices": [choice]}
        return event(body | ({"usage": usage} if usage else {})) + DONE

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.route == CHAT:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return self._base("chat.completion") | {"choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return self._base("text_completion") | {"choices": [choice], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def error(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = {400: "invalid_request_error", 401: "authentication_error",
            404: "not_found_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def models(name: str) -> dict[str, Any]:
    """`GET v1/models`: this model alone."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "compress"}]}
