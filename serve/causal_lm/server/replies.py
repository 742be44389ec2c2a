"""How a served causal LM's answers leave its handler: each streamed chunk sent for one
request alone, the error answers, and the bodies of compress's own NDJSON answers (OpenAI's
are `openai_routes.Answer`'s; `choices.py` follows a request's rows to them).

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
import uuid
from typing import Any

from ts.handler_utils.utils import send_intermediate_predict_response

from serve.handler_metrics import record
from serve.http_answers import reason_phrase

from . import openai as openai_routes

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


def drop_raw_bodies() -> None:
    """Make TorchServe's worker let go of each request's raw message once the handler's
    input is built from it (TorchServe 0.12's `Service.retrieve_data_for_inference`): its
    asynchronous `predict` holds the message until the request is answered, so a request
    waiting or decoding held its body (up to the request limit) though the handler had
    dropped its own copy once parsed."""
    from ts.service import Service

    retrieve = Service.retrieve_data_for_inference
    if getattr(retrieve, "drops_bodies", False):
        return

    def retrieve_dropping(batch):
        built = retrieve(batch)
        for request in batch:
            for parameter in request.get("parameters") or ():
                parameter["value"] = None  # the handler's input holds it now
        return built

    retrieve_dropping.drops_bodies = True
    Service.retrieve_data_for_inference = staticmethod(retrieve_dropping)


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
    body = openai_routes.error(message, status) if openai else {"error": message, "status": status}
    if streamed:
        return openai_routes.event(body) if openai else json.dumps(body) + "\n"
    context.set_response_content_type(i, "application/json")
    return json.dumps(body)


def failed(context, i: int, exc: BaseException, openai: bool, streamed: bool = False) -> str:
    """Request `i`'s 500 for an unexpected failure (logged with its traceback)."""
    return internal(context, i, f"{type(exc).__name__}: {exc}", openai, streamed, exc)


def internal(context, i: int, detail: str, openai: bool, streamed: bool = False,
             exc: BaseException | None = None) -> str:
    """Request `i`'s 500 for a failure inside the server: the client gets the request's id
    alone, `detail` (and the traceback, where given) goes to the log under it, as the
    LitServe engine answers its own failures (an exception's text can name files)."""
    error_id = (getattr(context, "request_ids", None) or {}).get(i) or uuid.uuid4().hex[:12]
    logger.error("compress LM handler: request %s failed: %s", error_id, detail,
                 exc_info=exc)
    return error(context, i, f"generation failed (error id {error_id}): the server's log has "
                             f"the details", 500, openai, streamed)


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
