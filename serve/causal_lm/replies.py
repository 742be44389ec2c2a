"""How a served causal LM's answers leave its handler: each streamed chunk sent for one
request alone, the error answers, and the bodies of compress's own NDJSON answers or of
OpenAI's (through `lm_openai.Answer`).

Shipped in the causal-LM TorchServe archive beside `handler.py` (which may define only
one class); imports no compress code. A native streamed answer is NDJSON: `{"delta": text,
"tokens": n}` as the text grows, then `{"text", "usage": {"prompt_tokens",
"completion_tokens"}, "finish_reason"}`; an error is `{"error", "status"}`, or OpenAI's
error object on its routes.

A client that leaves: LitServe cancels the request's coroutine, and the handler then lets
its row go. TorchServe 0.12 cannot tell the worker: its frontend writes each chunk to the
closed channel and ignores the failure (RestJob), the worker's socket leads to the frontend,
not to the client, so every send succeeds, and the worker protocol has no cancel message
(only predict, load, unload, stats, describe); such a row decodes to its max_new_tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from ts.handler_utils.utils import send_intermediate_predict_response

from . import openai as lm_openai
from . import requests as lm_requests

try:  # inside the archive the shared modules lie at its root, beside the `causal_lm` package
    from handler_metrics import record
    from http_answers import reason_phrase
except ImportError:  # in the compress repository
    from serve.handler_metrics import record
    from serve.http_answers import reason_phrase

STREAM_TYPE = "application/x-ndjson"
BATCH_HEADER = "X-Batch-Size"
logger = logging.getLogger(__name__)
# TorchServe's asynchronous worker writes final answers from its sending thread while chunks
# go out from the event loop: unguarded, two messages interleaved on the socket (seen under
# fuzzing: the frontend read a 2 GB "message" and dropped the worker). Both write under it.
SOCKET_LOCK = threading.Lock()


def guard_async_worker_socket() -> None:
    """Make TorchServe's asynchronous worker send its final answers under SOCKET_LOCK
    (TorchServe 0.12's `AsyncService.send_responses`, guarded; its repository is archived)."""
    from ts.async_service import AsyncService

    if getattr(AsyncService.send_responses, "guarded", False):
        return

    def send_responses(self) -> None:
        while True:
            future = asyncio.run_coroutine_threadsafe(self.out_queue.get(), self.loop)
            message = future.result()
            with SOCKET_LOCK:
                self.service.cl_socket.sendall(message)

    send_responses.guarded = True
    AsyncService.send_responses = send_responses


def send(context, i: int, chunk: str) -> None:
    """One intermediate response (a streamed chunk) for request `i` alone: through the
    context's `send_chunk(i, chunk)` where the serving engine gives one (compress's second
    engine), else TorchServe's intermediate response."""
    send_chunk = getattr(context, "send_chunk", None)
    if send_chunk is not None:
        send_chunk(i, chunk)
        return
    with SOCKET_LOCK:
        send_intermediate_predict_response([""] * i + [chunk], {i: context.request_ids[i]},
                                           "Intermediate Prediction success", 200, context)


def error(context, i: int, message: str, status: int, openai: bool,
          streamed: bool = False) -> str:
    """Request `i`'s error answer: OpenAI's error object on its routes. `streamed`: after
    the first chunk of its stream (whose status and headers are gone): a server-sent event
    `data: {"error": {...}}` (OpenAI's client raises APIError) or an NDJSON line."""
    context.set_response_status(status, reason_phrase(message), idx=i)
    record(context, "CompressBadRequests" if status < 500 else "CompressFailedRequests", 1)
    body = lm_openai.error(message, status) if openai else {"error": message, "status": status}
    if streamed:
        return lm_openai.event(body) if openai else json.dumps(body) + "\n"
    context.set_response_content_type(i, "application/json")
    return json.dumps(body)


def failed(context, i: int, exc: BaseException, openai: bool, streamed: bool = False) -> str:
    """Request `i`'s 500 for an unexpected failure (logged with its traceback)."""
    logger.error("compress LM handler: request %d failed", i, exc_info=exc)
    return error(context, i, f"generation failed: {type(exc).__name__}", 500, openai,
                 streamed)


def queue_full(context, i: int, message: str, retry_after_s: int, openai: bool) -> str:
    """Request `i`'s 503 when the batcher's queue is full, with `Retry-After`."""
    context.set_response_header(i, "Retry-After", str(int(retry_after_s)))
    return error(context, i, message, 503, openai)


def native_chunk(piece: str, tokens: int) -> str:
    """One NDJSON line of a native streamed answer: `piece` of the text, `tokens` so far."""
    return json.dumps({"delta": piece, "tokens": tokens}) + "\n"


def native_answer(text: str, prompt_tokens: int, completion_tokens: int,
                  finish: str) -> dict[str, Any]:
    """A native answer's last object: the whole text, the token counts, why it ended."""
    return {"text": text, "usage": {"prompt_tokens": prompt_tokens,
                                    "completion_tokens": completion_tokens},
            "finish_reason": finish}


def chunk(answer: lm_openai.Answer | None, piece: str, tokens: int) -> str:
    """A streamed piece of the text: OpenAI's server-sent event on its routes (`answer`),
    else a native NDJSON line."""
    return answer.chunk(piece) if answer else native_chunk(piece, tokens)


def last(answer: lm_openai.Answer | None, text: str, prompt_tokens: int,
         completion_tokens: int, finish: str, stream: bool, usage_in_stream: bool) -> str:
    """A request's last answer: the native NDJSON line, or on OpenAI's routes (`answer`) the
    final event of a stream (with `usage` when the request asked for it) or the whole
    completion."""
    if answer is None:
        return json.dumps(native_answer(text, prompt_tokens, completion_tokens, finish)) + "\n"
    usage = lm_openai.usage(prompt_tokens, completion_tokens)
    if stream:
        return answer.last_chunk(finish, usage if usage_in_stream else None)
    return json.dumps(answer.whole(text, finish, usage))


async def stream_answer(context, i: int, batcher: Any, row: Any, queue: asyncio.Queue,
                        stream: lm_requests.TextStream, parsed: lm_requests.GenerationRequest,
                        answer: lm_openai.Answer | None, usage_in_stream: bool,
                        began: float) -> str:
    """Request `i`'s answer from the `(token, end)` pairs its `row` of `batcher` puts in
    `queue`: each new piece of text sent as it comes (if it streams), then its last answer;
    what was held back for a stop string that never came is sent before it, so the deltas
    add up to the text. A stop string lets the row go (`batcher.cancel`)."""
    while True:
        token, end = await queue.get()
        if token is None:
            finish = end or "stop"
            break
        if stream.stopped:
            continue
        if len(stream.tokens) == 0:
            busy = batcher.busy()
            context.set_response_header(i, BATCH_HEADER, str(busy))
            record(context, "CompressBatchRows", busy)
            record(context, "CompressQueueTime", 1000 * (row.admitted - began))
            record(context, "CompressTimeToFirstToken", 1000 * (time.perf_counter() - began))
        piece = stream.add(token)
        if stream.stopped:
            batcher.cancel(row)
        if piece and parsed.stream:
            send(context, i, chunk(answer, piece, len(stream.tokens)))
    record(context, "CompressGeneratedTokens", len(stream.tokens))
    if finish.startswith("error"):
        return error(context, i, finish, 500, openai=answer is not None,
                     streamed=parsed.stream and stream.sent > 0)
    # "cancelled": the batcher's end of a row that a stop string let go
    finish = "stop" if stream.stopped or finish not in ("length", "stop") else finish
    piece = stream.flush()
    if piece and parsed.stream:
        send(context, i, chunk(answer, piece, len(stream.tokens)))
    return last(answer, stream.text, len(parsed.ids), len(stream.tokens), finish,
                parsed.stream, usage_in_stream)
