"""Requests to a served causal LM: parsing and limits, and the text each answer streams.

Shipped in the causal-LM TorchServe archive beside `lm_handler.py` (which may define only
one class) and `lm_runtime.py`; imports no compress code, and no torch.

A request is a JSON object: `prompt` (a string) or `messages` (chat messages, through the
tokenizer's chat template), and optionally `max_new_tokens`, `temperature` (0: greedy),
`top_p`, `stop` (strings that end the text, not included), `seed` (for sampling) and
`stream` (default true: the text comes in NDJSON chunks as it is generated).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "stop", "seed",
          "stream")
MAX_STOPS = 8


@dataclass(frozen=True)
class Limits:
    """What a request may ask for."""

    max_new_tokens: int = 256
    default_new_tokens: int = 64
    cache_len: int = 512  # prompt + new tokens per row
    chat_template: bool = True  # a plain `prompt` goes through the chat template too


@dataclass
class GenerationRequest:
    """One parsed request."""

    ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = True


def read_body(request: dict[str, Any]) -> dict[str, Any]:
    """The JSON object of a TorchServe request (ValueError: its message goes back as 400)."""
    body = request.get("body", request.get("data"))
    if isinstance(body, bytes | bytearray):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the body is not UTF-8 text") from None
    if isinstance(body, str):
        try:
            body = json.loads(body) if body.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError('send a JSON object: {"prompt": "..."} or {"messages": [{"role": '
                         '"user", "content": "..."}]}, with optional max_new_tokens, '
                         "temperature, top_p, stop, seed, stream")
    return body


def parse(body: dict[str, Any], encode, limits: Limits) -> GenerationRequest:
    """Check a request body against `limits`; `encode(prompt or messages)` -> token ids."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if ("prompt" in body) == ("messages" in body):
        raise ValueError('give exactly one of "prompt" (a string) and "messages" (a list '
                         'of {"role", "content"})')
    prompt = body.get("prompt", body.get("messages"))
    if "prompt" in body and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError("empty prompt: send a non-empty string")
    if "messages" in body and (not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt)):
        raise ValueError('messages: a non-empty list of {"role": str, "content": str}')
    if "messages" in body and not any(m["content"].strip() for m in prompt):
        raise ValueError("empty prompt: every message is empty")
    new = _number(body, "max_new_tokens", limits.default_new_tokens, 1,
                  limits.max_new_tokens, integer=True)
    temperature = _number(body, "temperature", 0.0, 0.0, 10.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise ValueError("top_p: must be above 0 (1 keeps every token)")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(
            isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop: a string or a list of at most {MAX_STOPS} non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError("seed: a non-negative integer")
    if not isinstance(body.get("stream", True), bool):
        raise ValueError("stream: true or false")
    ids = encode(prompt)
    if len(ids) + new > limits.cache_len:
        raise ValueError(f"prompt too long: {len(ids)} tokens + max_new_tokens {new} exceed "
                         f"the context of {limits.cache_len} tokens")
    return GenerationRequest(ids, int(new), float(temperature), float(top_p), list(stop),
                             seed, body.get("stream", True))


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float,
            integer: bool = False) -> Any:
    value = body.get(name, default)
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name}: {what} from {low:g} to {high:g}, got {value!r}")
    return value


class TextStream:
    """The text of one row as its tokens come: what may be sent now (never a part that a
    stop string could still claim, nor half a UTF-8 character), and where it ends."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""  # all of it so far, cut at a stop string
        self.sent = 0  # characters of `text` already streamed
        self.stopped = False  # a stop string was seen

    def add(self, token: int) -> str:
        """Take one token; the text that may be streamed now ("" when none)."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        held = max((k for s in self.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        end = len(text) - held
        while end > self.sent and text[end - 1] == "\ufffd":  # an incomplete character
            end -= 1
        return self._take(end)

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece
