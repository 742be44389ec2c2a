"""TorchServe's inference URLs as a LitServe spec, so that clients (the tests, `compress
loadtest`, the `openai` client) change only the base URL between engines.

`POST|PUT|GET /predictions/MODEL[/VERSION[/PATH]]`: the body (`body.read_body`: at most
`max_request_size` bytes, else 413) goes to the worker as TorchServe hands it to a handler,
`{"body": bytes}` (an urlencoded form: one entry per field, at most 1000), with the
request's headers, the body's content type and `url_path` (PATH, e.g.
`v1/chat/completions`). The answer waits for the worker's first message: the whole answer,
or the first chunk of a stream, whose status and headers are those the handler set before
sending it (so a bad streamed request is still a 400).

A request ends whatever happens (`inflight`): past the archive's `responseTimeout` without
a message it gets a 504, if its worker dies a 503 (an error line once a stream has begun);
if its client leaves, or it times out, the worker is told to cancel it. Errors outside the
handler are TorchServe's JSON: `{"code", "type", "message"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from litserve.specs.base import LitSpec

from compress.serving.handler_host.body import handler_request
from compress.serving.handler_host.errors import error_body, error_line
from compress.serving.handler_host.handler import RESPONSE_TIMEOUT_S
from compress.serving.litserve import inflight
from compress.serving.litserve.inflight import JSON, Message, Pending

logger = logging.getLogger(__name__)


async def ping(request: Request) -> JSONResponse:
    """TorchServe's health check (no token): the server listens once a worker is ready."""
    return JSONResponse({"status": "Healthy"})


class ClientLeft(Exception):
    """The client disconnected before its answer began."""


class TorchServeRoutes(LitSpec):
    """The prediction routes of one model; answers come from `HandlerLoop` as messages."""

    def __init__(self, model_name: str, version: str | None, max_request_size: int,
                 timeout_s: float = RESPONSE_TIMEOUT_S):
        super().__init__()
        self.model_name, self.version = model_name, version
        self.max_request_size, self.timeout_s = max_request_size, timeout_s
        self.api_path = f"/predictions/{model_name}"
        self.controls: list[Any] | None = None  # each worker's cancel queue (main.Server)
        self.hold_s = inflight.IDLE_GET_S  # the longest get of a worker (HandlerAPI sets it)
        self.group_size = 1  # requests in one put on the request queue (HandlerAPI sets it)
        self._outgoing: list[tuple] = []  # requests read in this pass of the event loop
        self._watch: asyncio.Task | None = None
        self._dispatch: asyncio.Task | None = None

    @property
    def stream(self) -> bool:
        return True  # every answer comes as messages: chunks (if any), then the end

    def pre_setup(self, lit_api: Any) -> None:
        for path in ("", "/{version}", "/{version}/{path:path}"):
            self.add_endpoint(self.api_path + path, self.predict, ["GET", "POST", "PUT"])

    def decode_request(self, request: Any, context_kwargs: Any = None) -> Any:
        return request

    def encode_response(self, output: Any, context_kwargs: Any = None) -> Any:
        return output

    async def predict(self, request: Request) -> Response:
        """Send one request to a worker; answer with what it sends back."""
        data, headers = await handler_request(request, self.model_name, self.version,
                                              self.max_request_size)
        if self._watch is None or self._watch.done():
            entry = self.response_buffer[inflight.BATCH] = inflight.dispatch_entry()
            events = asyncio.get_running_loop()
            self._watch = events.create_task(inflight.watch(self.response_buffer, self.hold_s))
            self._dispatch = events.create_task(inflight.dispatch(self.response_buffer, entry))
        uid = str(uuid.uuid4())
        pending = Pending(event=asyncio.Event(), response_queue=deque(), uid=uid,
                          controls=self.controls)
        self.response_buffer[uid] = pending
        messages = self._messages(pending)
        try:
            self._enqueue((self.response_queue_id, uid, time.monotonic(), (data, headers)))
            del data  # the worker's now: no copy kept here while the answer is awaited
            kind, status, answer_headers, media, first = await _first(request, messages)
        except (ClientLeft, TimeoutError) as exc:
            pending.cancel()
            await messages.aclose()
            if isinstance(exc, ClientLeft):
                return Response(status_code=499)  # nobody reads it
            return JSONResponse(error_body(504, str(exc)), status_code=504)
        except BaseException:
            pending.cancel()
            await messages.aclose()
            raise
        if kind in (inflight.END, inflight.FAIL):
            await messages.aclose()
            return Response(first, status, answer_headers, media_type=media or JSON)
        return Stream(_chain(first, messages, media), pending.cancel, status_code=status,
                      headers=answer_headers, media_type=media or JSON)

    def _enqueue(self, request: tuple) -> None:
        """Queue one request for the workers: those read in the same pass of the event loop
        go in groups of `group_size`, one manager round trip a group (`_send_outgoing`)."""
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._send_outgoing)
        self._outgoing.append(request)

    def _send_outgoing(self) -> None:
        waiting, self._outgoing = self._outgoing, []
        for start in range(0, len(waiting), self.group_size):
            group = waiting[start:start + self.group_size]
            try:
                self.request_queue.put(group)
            except Exception:  # the manager is gone: the server is stopping
                logger.exception("could not queue %d requests", len(group))
                for _, uid, _, _ in group:
                    pending = self.response_buffer.get(uid)
                    if isinstance(pending, Pending):
                        inflight.end(pending, 503, "the server is stopping")

    async def _messages(self, pending: Pending) -> AsyncIterator[Message]:
        try:
            async for message in inflight.messages(pending, self.timeout_s):
                yield message
        finally:
            self.response_buffer.pop(pending.uid, None)


async def _first(request: Request, messages: AsyncIterator[Message]) -> Message:
    """The worker's first message; ClientLeft if the client disconnects first."""
    answer = asyncio.ensure_future(anext(messages))
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({answer, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (left, answer):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    if answer.cancelled():
        raise ClientLeft
    return answer.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client has disconnected (its body was read in full before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chain(first: bytes, messages: AsyncIterator[Message],
                 media: str | None) -> AsyncIterator[bytes]:
    """A stream's bytes; a timeout or the engine's failure ends it with an error line."""
    yield first
    try:
        async for kind, status, _, _, data in messages:
            if kind == inflight.FAIL:
                message = json.loads(data).get("message", "failed")
                yield error_line(media, status, message)
                return
            yield data
    except TimeoutError as exc:
        yield error_line(media, 504, str(exc))


class Stream(StreamingResponse):
    """A streamed answer that calls `on_close` however it ends (the client left, the send
    failed, it finished: `Pending.cancel` does nothing once the last message came)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()
