"""One load-test thread's streamed OpenAI chat completions: POST a `/v1/chat/completions`
body with `stream: true` and read its server-sent events as they arrive.

An answer is `data: {chunk}` events, each a `chat.completion.chunk` whose
`choices[0].delta.content` carries a piece of the text, perhaps a last chunk with `usage`
(when `stream_options.include_usage` asks for it: one more chunk with no choices, as
OpenAI, llama-server and compress's servers send it), then `data: [DONE]`.
Per answer this keeps:

- time to first token: from sending the request to the first event with non-empty content
  (a first event that carries only the role is not a token);
- inter-token gaps: the times between consecutive content events;
- completion tokens: `usage.completion_tokens` when the stream gave usage, else the number
  of content events (`tokens_from` says which);
- an error: a status other than 200, an `error` object in the stream, a stream that ends
  without `[DONE]`, or any exception.
"""

from __future__ import annotations

import http.client
import json
import time
from itertools import pairwise
from typing import Any

from compress.serving.loadtest.workers import STALE_CONNECTION_ERRORS

DONE = "[DONE]"


class StreamError(RuntimeError):
    """An answer that did not complete as OpenAI's stream does."""


def content_of(chunk: dict[str, Any]) -> str:
    """The text a chat.completion.chunk adds ("" for role-only, usage or final chunks)."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta") or {}
    text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else ""


def read_events(answer: http.client.HTTPResponse):
    """(arrival time, data) of each `data:` line of a server-sent event stream, in order,
    until `[DONE]` (yielded too) or the end of the body."""
    while line := answer.readline():
        now = time.perf_counter()
        text = line.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            continue  # blank separators, comments (": ..."), `event:` / `id:` fields
        data = text[5:].strip()
        yield now, data
        if data == DONE:
            return


class ChatStream:
    """One thread's connection and what its streamed chat answers showed."""

    def __init__(self, host: str, port: int | None, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None
        self.used = False  # whether self.conn has carried a request already
        self.rows: list[dict[str, Any]] = []  # per answer: ttft, latency, tokens, gaps
        self.errors: list[str] = []

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def _open(self, path: str, body: bytes, headers: dict[str, str]
              ) -> tuple[http.client.HTTPResponse, float]:
        """(the answer's response, when its request was sent), once more on a fresh
        connection when a reused one turned out closed."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                self.used = False
            reused, began = self.used, time.perf_counter()
            try:
                self.conn.request("POST", path, body=body, headers=headers)
                self.used = True
                return self.conn.getresponse(), began
            except STALE_CONNECTION_ERRORS:
                self.close()
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def send(self, path: str, body: bytes, headers: dict[str, str], record: bool) -> None:
        """POST one streamed chat completion and read it to the end; when `record`, keep
        its figures or its error."""
        try:
            row = self._exchange(path, body, headers)
        except Exception as exc:  # any failure is one counted error
            self.close()
            if record:
                self.errors.append(" ".join(f"{type(exc).__name__}: {exc}".split())[:240])
            return
        if record:
            self.rows.append(row)

    def _exchange(self, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        answer, began = self._open(path, body, headers)
        if answer.status != 200:
            raise StreamError(f"HTTP {answer.status}: "
                              f"{answer.read()[:200].decode('utf-8', errors='replace')}")
        arrivals: list[float] = []
        usage, done = None, False
        for at, data in read_events(answer):
            if data == DONE:
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise StreamError(f"an event that is not a JSON object: {data[:120]}")
            if chunk.get("error"):
                raise StreamError(f"error in the stream: {json.dumps(chunk['error'])[:200]}")
            if content_of(chunk):
                arrivals.append(at)
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
        answer.read()  # the rest of the body (the chunked encoding's end): the connection
        ended = time.perf_counter()  # then takes the next request
        if not done:
            raise StreamError("the stream ended without data: [DONE]")
        if not arrivals:
            raise StreamError("the stream carried no content")
        counted = usage is not None and isinstance(usage.get("completion_tokens"), int)
        return {"ttft_ms": 1000 * (arrivals[0] - began), "latency_ms": 1000 * (ended - began),
                "gaps_ms": [1000 * (b - a) for a, b in pairwise(arrivals)],
                "chunks": len(arrivals),
                "tokens": int(usage["completion_tokens"]) if counted else len(arrivals),
                "tokens_from": "usage" if counted else "chunks",
                "prompt_tokens": (int(usage["prompt_tokens"]) if counted and isinstance(
                    usage.get("prompt_tokens"), int) else None)}
