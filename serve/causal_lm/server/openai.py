"""OpenAI's API for a served causal LM (shipped beside `handler.py`; no torch, no compress):
the routes `v1/chat/completions`, `v1/completions` and `v1/models` under the model's
prediction URL, so that the `openai` client reaches it with
`base_url=http://HOST:PORT/predictions/MODEL/VERSION/v1` and the inference token as its key.

A request body becomes the native request of `requests.py` (`openai_request.py`); answers
are OpenAI's objects (`Answer`), streamed as server-sent events (`data: {chunk}` lines, each
choice's last chunk with its `finish_reason`, a chunk with empty `choices` and the `usage`
where `stream_options.include_usage` asks for it, then `data: [DONE]`); errors are OpenAI
error objects.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serve.http_answers import openai_error as error  # noqa: F401
from serve.http_answers import openai_models as models  # noqa: F401

from . import tools as tool_calls
from .openai_request import CHAT, COMPLETIONS, Wanted

MODELS = "v1/models"
ROUTES = (CHAT, COMPLETIONS, MODELS)
STREAM_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"
# a token's log-probability and its rivals', as `picking.py` records them
TokenLogprobs = tuple[float, list[tuple[int, float]]]


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


@dataclass
class Choice:
    """One choice's text as it grows: its tokens' ids and log-probabilities."""

    index: int
    text: str = ""
    finish: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    reported: int = 0  # tokens whose log-probabilities went out in a chunk
    chars: int = 0  # the length of those tokens' texts (completions' `text_offset`)
    echo: str = ""  # completions' echo: the prompt, written before the text
    prompt: list[int] = field(default_factory=list)  # and its tokens, where they were scored,
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # each after the first


class Answer:
    """The OpenAI objects of one request's choices: chunks as the texts grow, then the
    end. `token_text(id)`: a token's text (its log-probabilities name it)."""

    def __init__(self, route: str, model: str, wanted: Wanted | None = None,
                 token_text: Callable[[int], str] = str):
        self.route, self.model = route, model
        self.wanted = wanted or Wanted()
        self.token_text = token_text
        self.id = ("chatcmpl-" if route == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.started: set[int] = set()  # choices whose first chunk went out

    @property
    def holds_text(self) -> bool:
        """Whether the text is kept until the end (it is JSON read back as tool calls)."""
        return self.wanted.tools is not None

    def _base(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> str:
        kind = "chat.completion.chunk" if self.route == CHAT else "text_completion"
        return event(self._base(kind) | {"choices": [choice]}
                     | ({"usage": None} if self.wanted.include_usage else {}))

    def chunk(self, choice: Choice, piece: str) -> str:
        """One server-sent event carrying `piece` of a choice's text (and the
        log-probabilities of its tokens not yet reported)."""
        return self._chunk(self._choice(choice, piece, None, streamed=True))

    def _choice(self, choice: Choice, piece: str, finish: str | None, streamed: bool,
                delta: dict[str, Any] | None = None) -> dict[str, Any]:
        logprobs = self._logprobs(choice, streamed)
        if self.route == CHAT:
            if delta is None:
                delta = {"content": piece} if piece or not streamed else {}
            if streamed and choice.index not in self.started:
                delta = {"role": "assistant"} | delta
            self.started.add(choice.index)
            return {"index": choice.index, "delta" if streamed else "message": delta,
                    "logprobs": logprobs, "finish_reason": finish}
        text = choice.echo + piece if not streamed or (
            choice.index not in self.started) else piece
        self.started.add(choice.index)
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish}

    def _logprobs(self, choice: Choice, streamed: bool) -> dict[str, Any] | None:
        if not self.wanted.logprobs:
            return None
        first = choice.reported if streamed else 0
        # the batcher may have recorded tokens this choice has not taken yet: only its own
        entries = list(zip(choice.tokens[first:], choice.logprobs[first:], strict=False))
        choice.reported = first + len(entries)
        if self.route == CHAT:
            return {"content": [self._token(t, lp) | {"top_logprobs": [
                self._token(r, rlp) for r, rlp in rivals]} for t, (lp, rivals) in entries],
                    "refusal": None}
        texts = [self.token_text(t) for t, _ in entries]
        at = len(choice.echo) + (choice.chars if streamed else 0)
        offsets = []
        for text in texts:
            offsets.append(at)
            at += len(text)
        choice.chars = at - len(choice.echo)
        logprobs: list[float | None] = [lp for _, (lp, _) in entries]
        tops: list[dict[str, float] | None] = [self._rivals(rivals)
                                               for _, (_, rivals) in entries]
        if choice.prompt and not streamed:  # the prompt's tokens first, the first unscored
            prompt = [self.token_text(t) for t in choice.prompt]
            starts = [0, *itertools.accumulate(len(p) for p in prompt[:-1])]
            texts, offsets = prompt + texts, starts + offsets
            logprobs = [None] + [lp for lp, _ in choice.prompt_logprobs] + logprobs
            tops = [None] + [self._rivals(rivals) for _, rivals in choice.prompt_logprobs] + tops
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _rivals(self, rivals: list[tuple[int, float]]) -> dict[str, float]:
        """Completions' `top_logprobs` entry: each rival's text and log-probability."""
        return {self.token_text(r): logprob for r, logprob in rivals}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def last_chunks(self, choice: Choice, held: str) -> str:
        """A choice's last events: what the text held back (`held`; with tools, all of it,
        read back as tool calls), then its `finish_reason`."""
        events = ""
        if self.route == CHAT and self.holds_text:
            calls, content = tool_calls.called(choice.text)
            if calls is not None:
                for k, call in enumerate(calls):
                    events += self._chunk(self._choice(choice, "", None, True, {
                        "tool_calls": [{"index": k} | call]}))
                choice.finish = "tool_calls"
            elif content:
                events += self._chunk(self._choice(choice, content, None, True))
        elif held:
            events += self._chunk(self._choice(choice, held, None, True))
        return events + self._chunk(self._choice(choice, "", choice.finish, True, {}))

    def end(self, usage: dict[str, int]) -> str:
        """A stream's end: the usage chunk (where asked for), then `[DONE]`."""
        if not self.wanted.include_usage:
            return DONE
        kind = "chat.completion.chunk" if self.route == CHAT else "text_completion"
        return event(self._base(kind) | {"choices": [], "usage": usage}) + DONE

    def whole(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        """The non-streamed answer."""
        bodies = []
        for choice in choices:
            if self.route != CHAT:
                bodies.append(self._choice(choice, choice.text, choice.finish, False))
                continue
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if self.holds_text:
                calls, content = tool_calls.called(choice.text)
                message["content"] = None if calls is not None else content
                if calls is not None:
                    message["tool_calls"] = calls
                    choice.finish = "tool_calls"
            bodies.append(self._choice(choice, "", choice.finish, False, message))
        kind = "chat.completion" if self.route == CHAT else "text_completion"
        return self._base(kind) | {"choices": bodies, "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
