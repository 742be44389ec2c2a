"""Requests to a served causal LM: parsing and limits, and the text each answer streams.

Shipped in the causal-LM TorchServe archive beside `handler.py` (which may define only
one class) and the runtime; imports no compress code, and no torch.

A request is a JSON object: `prompt` (a string, or token ids: a list of integers) or
`messages` (chat messages, through the tokenizer's chat template), and optionally
`max_new_tokens`, `temperature` (0: greedy), `top_p`, `stop` (strings that end the text,
not included), `seed` (for sampling), `ignore_eos` (true: the end token does not end the
text, as vLLM's and llama-server's option; on continuous-batching archives) and `stream`
(default true: the text comes in NDJSON chunks as it is generated). On
continuous-batching archives also `n` (answers that share one prefill), `logprobs` (0-20:
each token's log-probability and that many likeliest rivals) and `json_schema` (the answer
is JSON valid against it: `grammar.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve.handler_settings import HandlerSettings

from . import openai_request, tools

FIELDS = ("prompt", "messages", "max_new_tokens", "temperature", "top_p", "stop", "seed",
          "ignore_eos", "stream", "n", "logprobs", "json_schema")
MAX_CHOICES = 8  # `n`: answers to one prompt, each a row of the batch
MAX_LOGPROBS = 20  # `logprobs`: rivals reported per token
MAX_STOPS = 8
MAX_STOP_CHARS = 64  # bounds the text a stop check looks at on every token
MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflow to inf and sampling fails
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below it
FROZEN_CHARS = 1024  # TextStream: text sent is set aside in pieces of at least this much


@dataclass(frozen=True)
class Limits:
    """What a request may ask for."""

    max_new_tokens: int = HandlerSettings.max_new_tokens
    default_new_tokens: int = HandlerSettings.default_new_tokens
    cache_len: int = HandlerSettings.cache_len  # prompt + new tokens per row
    chat_template: bool = HandlerSettings.chat_template  # a plain `prompt` through it too
    max_prompt_chars: int = 0  # more characters cannot fit cache_len tokens (0: no bound)
    max_schema_chars: int = HandlerSettings.max_schema_chars  # a json_schema's JSON text
    vocab: int = 0  # a prompt's token ids are below it (0: unchecked)


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
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    json_schema: dict[str, Any] | None = None
    prompt_text: str | None = None  # the prompt as sent, where it was a string
    score_prompt: bool = False  # each prompt token's log-probability too (OpenAI's echo)


def read_body(request: dict[str, Any], content_type: str = "") -> dict[str, Any]:
    """The JSON object of a TorchServe request (ValueError: its message goes back as 400).
    TorchServe's worker decodes an `application/json` body itself: a str it hands over
    with that `content_type` is a JSON string, not an object (LitServe hands over the bytes,
    parsed here once: the same answer on both engines)."""
    body = request.get("body", request.get("data"))
    if isinstance(body, str) and content_type == "application/json":
        body = None  # a JSON string: refused below, as LitServe's bytes of it are
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
        except RecursionError:
            raise ValueError("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError('send a JSON object: {"prompt": "..."} or {"messages": [{"role": '
                         '"user", "content": "..."}]}, with optional max_new_tokens, '
                         "temperature, top_p, stop, seed, stream")
    return body


def parse_request(request: dict[str, Any], route: str | None, encode, limits: Limits,
                  content_type: str = ""
                  ) -> tuple[list[GenerationRequest], openai_request.Wanted | None]:
    """(a TorchServe request parsed: one per prompt, several where OpenAI's completions
    name several; what its OpenAI answer carries beyond the text: None on the native API),
    on OpenAI's `route` where given. ValueError: a 400 that says why."""
    body = read_body(request, content_type)
    if route is None:
        return [parse(body, encode, limits)], None
    body, wanted = openai_request.native_body(route, body)
    scored = body.pop("prompt_logprobs", False)
    prompts = body.pop("prompts", None)
    if prompts is None:  # a tool's schema is in the prompt already (its instructions)
        return [parse(body, encode, limits, schema_in_prompt=wanted.tools is not None)], wanted
    return [parse(body | {"prompt": prompt}, encode, limits, echoed=wanted.echo,
                  score_prompt=scored) for prompt in prompts], wanted


def parse(body: dict[str, Any], encode, limits: Limits, schema_in_prompt: bool = False,
          echoed: bool = False, score_prompt: bool = False) -> GenerationRequest:
    """Check a request body against `limits`; `encode(prompt or messages)` -> token ids
    (a prompt of token ids is taken as it is). The json_schema's text counts in the
    prompt's characters unless `schema_in_prompt`. `echoed` (OpenAI's echo): the prompt
    alone may be asked for (`max_new_tokens` 0); `score_prompt`: its tokens'
    log-probabilities too."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if ("prompt" in body) == ("messages" in body):
        raise ValueError('give exactly one of "prompt" (a string) and "messages" (a list '
                         'of {"role", "content"})')
    prompt = body.get("prompt", body.get("messages"))
    ids = _token_ids(prompt, limits.vocab) if isinstance(prompt, list) and (
        "prompt" in body) else None
    if "prompt" in body and ids is None and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError("empty prompt: send a non-empty string")
    if "messages" in body and (not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt)):
        raise ValueError('messages: a non-empty list of {"role": str, "content": str}')
    if "messages" in body and not any(m["content"].strip() for m in prompt):
        raise ValueError("empty prompt: every message is empty")
    new = _number(body, "max_new_tokens", limits.default_new_tokens, 0 if echoed else 1,
                  limits.max_new_tokens, integer=True)
    temperature = _number(body, "temperature", 0.0, 0.0, 10.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature: 0 (greedy) or from {MIN_TEMPERATURE:g} to 10, got "
                         f"{temperature!r}")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise ValueError("top_p: must be above 0 (1 keeps every token)")
    stop = body.get("stop")  # a falsy stop that is no string or list (0, false, {}) is a 400
    stop = [] if stop is None else [stop] if isinstance(stop, str) and stop else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ValueError(f"stop: a string or a list of at most {MAX_STOPS} non-empty strings "
                         f"of at most {MAX_STOP_CHARS} characters")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"seed: an integer from 0 to 2**64 - 1, got {seed!r}")
    for name, default in (("stream", True), ("ignore_eos", False)):
        if not isinstance(body.get(name, default), bool):
            raise ValueError(f"{name}: true or false")
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    schema = body.get("json_schema")
    schema_chars = 0 if schema is None else _schema_chars(schema, limits.max_schema_chars)
    chars = 0 if ids is not None else len(prompt) if isinstance(prompt, str) else sum(
        len(m["content"]) for m in prompt)
    if limits.max_prompt_chars and schema_chars and not schema_in_prompt and (
            chars + schema_chars > limits.max_prompt_chars):
        raise ValueError(f"prompt too long: {chars} characters and a JSON schema of "
                         f"{schema_chars} exceed the {limits.max_prompt_chars} that the "
                         f"context of {limits.cache_len} tokens takes")
    if limits.max_prompt_chars and chars > limits.max_prompt_chars:
        raise ValueError(f"prompt too long: {chars} characters cannot fit the context of "
                         f"{limits.cache_len} tokens")
    if ids is None:
        ids = _encoded(encode, prompt)
    if len(ids) + new > limits.cache_len:
        raise ValueError(f"prompt too long: {len(ids)} tokens + max_new_tokens {new} exceed "
                         f"the context of {limits.cache_len} tokens")
    return GenerationRequest(ids, int(new), float(temperature), float(top_p), list(stop),
                             seed, body.get("stream", True), body.get("ignore_eos", False),
                             int(n), logprobs, schema,
                             prompt if isinstance(prompt, str) else None, score_prompt)


def _token_ids(prompt: list[Any], vocab: int) -> list[int]:
    """A prompt given as token ids, checked: integers from 0, below the vocabulary's size."""
    if not prompt or not all(openai_request.is_token_id(i) for i in prompt):
        raise ValueError("prompt: token ids are a non-empty list of integers from 0")
    if vocab and max(prompt) >= vocab:
        raise ValueError(f"prompt: token id {max(prompt)} is past the vocabulary "
                         f"({vocab} tokens)")
    return [int(i) for i in prompt]


def _schema_chars(schema: Any, bound: int) -> int:
    """The length of `schema`'s JSON text; ValueError where it is no object, is nested past
    MAX_SCHEMA_DEPTH, or is longer than `bound` (compiling it costs about 3 us a
    character, on the worker's grammar thread; 0: no bound)."""
    if not isinstance(schema, dict):
        raise ValueError("json_schema: a JSON schema (an object)")
    tools.check_depth(schema, "the JSON schema")
    chars = len(json.dumps(schema))
    if bound and chars > bound:
        raise ValueError(f"the JSON schema is {chars} characters long: this server takes "
                         f"at most {bound} characters (response_format, tools, json_schema)")
    return chars


def prompt_chars_bound(tokenizer: Any, cache_len: int) -> int:
    """Characters past which a prompt cannot fit `cache_len` tokens, checked before it is
    tokenized: a token holds at most its vocabulary's longest string (4x leaves room for
    what a tokenizer's normalization drops); 0 where the vocabulary is unknown."""
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no bound
        return 0
    return 4 * max(longest, 1) * cache_len


def _encoded(encode, prompt: str | list[dict[str, str]]) -> list[int]:
    """`encode(prompt)`; whatever it raises (a chat template's own error, say) is a
    ValueError, so the request fails alone with a 400."""
    try:
        ids = list(encode(prompt))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizer's errors are the request's
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ValueError(f"the prompt could not be encoded: {lines[0]}") from None
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


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
    stop string could still claim, nor half a UTF-8 character), and where it ends.

    Decoded incrementally, as Hugging Face's TextStreamer and vLLM's detokenizer do: each
    token decodes a short window, the tokens since `prefix` (those of the last text
    taken, so that a tokenizer that drops a leading space, or joins a word's pieces, does
    so the same way with and without the new tokens) with and without the new ones; what
    the new ones add is the window's text past the prefix's. A window whose text ends in
    half a character (U+FFFD: a byte-level or byte-fallback token that a later one
    completes) grows until the character is whole. So `text` is the sum of what the
    windows added, and the deltas add up to it.

    No token's work grows with the row: each stop check looks only at the text not yet
    sent and `longest` characters before it (what could begin a stop string is never
    sent), and text sent long ago is set aside (`frozen`), never copied again."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, list(dict.fromkeys(stop))
        self.longest = max((len(s) for s in self.stop), default=0)
        self.firsts = {s[0] for s in self.stop}
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already streamed
        self.stopped = False  # a stop string was seen
        self.prefix = self.read = 0  # the window's first token, the first not yet taken
        self.prefix_text = ""  # the text of tokens[prefix:read], decoded alone
        self.frozen: list[str] = []  # the text's start: sent, past every stop check
        self.base = 0  # its length
        self.live = ""  # the text of tokens[:read] after `frozen`
        self.shown = ""  # `live` and what the tokens after `read` add (half a character),
        # cut at a stop string

    @property
    def text(self) -> str:
        """All of it so far, cut at a stop string."""
        return "".join(self.frozen) + self.shown

    def add(self, token: int) -> str:
        """Take one token; the text that may be streamed now ("" when none)."""
        self.tokens.append(token)
        if self.stopped:
            return ""
        window = self._decode(self.tokens[self.prefix:])
        shown = self.live + window[len(self.prefix_text):]
        if len(window) > len(self.prefix_text) and not window.endswith("\ufffd"):
            # whole characters: the window moves on to the tokens just taken
            self.prefix, self.read = self.read, len(self.tokens)
            self.prefix_text = self._decode(self.tokens[self.prefix:self.read])
            self.live = shown
        start = max(0, self.sent - self.base - self.longest)
        cut = min((i for i in (shown.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:  # (never before what was sent: the deltas add up to the text)
            cut = max(cut, self.sent - self.base)
            self.shown, self.stopped = shown[:cut], True
            return self._take(self.base + cut)
        self.shown = shown
        end = len(shown)
        while end > self.sent - self.base and shown[end - 1] == "\ufffd":  # half a character
            end -= 1
        piece = self._take(self.base + end - self._held(shown, end))
        self._freeze()
        return piece

    def flush(self) -> str:
        """The text held back so far (what could have begun a stop string, or half a
        character): to be sent when generation ends by length or an end token, so that the
        deltas add up to `text`."""
        return self._take(self.base + len(self.shown))

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _freeze(self) -> None:
        """Set aside the text sent but its last `longest` characters, once there is much
        of it (only what whole tokens made: `live`)."""
        done = min(self.sent - self.base - self.longest, len(self.live))
        if done >= FROZEN_CHARS:
            self.frozen.append(self.live[:done])
            self.base += done
            self.live, self.shown = self.live[done:], self.shown[done:]

    def _held(self, text: str, end: int) -> int:
        """Length of the longest end of `text[:end]` that begins a stop string (shorter
        than it: a whole one was cut already)."""
        for i in range(max(end - self.longest + 1, 0), end):
            if text[i] in self.firsts and any(s.startswith(text[i:end]) for s in self.stop):
                return end - i
        return 0

    def _take(self, end: int) -> str:
        """Send the text up to `end` (counted from its start)."""
        if end <= self.sent:
            return ""
        piece = self.shown[self.sent - self.base:end - self.base]
        self.sent = end
        return piece
