"""TorchServe's inference URLs as a LitServe spec, so that clients (the tests, `compress
loadtest`, the `openai` client) change only the base URL between engines.

`POST|PUT|GET /predictions/MODEL[/VERSION[/PATH]]`: the body (at most `max_request_size`
bytes, else 413) goes to the worker as TorchServe hands it to a handler, `{"body": bytes}`
(an urlencoded form: one entry per field), with the request's headers, the body's content
type and `url_path` (PATH, e.g. `v1/chat/completions`). The answer waits for the worker's
first message: the whole answer, or the first chunk of a stream, whose status and headers
are those the handler set before sending it (so a bad streamed request is still a 400).
Errors outside the handler are TorchServe's JSON: `{"code", "type", "message"}`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qsl

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem

TOKEN_FAILED = ("Token Authorization failed. Token either incorrect, expired, or not "
                "provided correctly")
MAX_REQUEST_SIZE = 6_553_500  # TorchServe's default max_request_size
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
ERROR_TYPES = {400: "BadRequestException", 401: "InvalidKeyException",
               404: "ModelNotFoundException", 405: "MethodNotAllowedException",
               413: "RequestTooLargeException"}
Message = tuple[str, int, dict[str, str], str | None, bytes]


def error_body(status: int, message: str) -> dict[str, Any]:
    """TorchServe's error object."""
    return {"code": status, "type": ERROR_TYPES.get(status, "InternalServerException"),
            "message": message}


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's HTTPException (a bad token, an unknown path) as TorchServe answers it."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    return JSONResponse(error_body(status, str(detail)), status_code=status,
                        headers=getattr(exc, "headers", None))


async def ping(request: Request) -> JSONResponse:
    """TorchServe's health check (no token): the server listens once a worker is ready."""
    return JSONResponse({"status": "Healthy"})


class TorchServeRoutes(LitSpec):
    """The prediction routes of one model; answers come from `HandlerLoop` as messages."""

    def __init__(self, model_name: str, version: str | None, max_request_size: int):
        super().__init__()
        self.model_name, self.version = model_name, version
        self.max_request_size = max_request_size
        self.api_path = f"/predictions/{model_name}"

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
        version = request.path_params.get("version")
        if version is not None and self.version is not None and version != self.version:
            raise HTTPException(404, f"Model version: {version} does not exist for model: "
                                     f"{self.model_name}")
        body = await read_body(request, self.max_request_size)
        content_type = request.headers.get("content-type", "")
        data: dict[str, Any] = {"body": body}
        if content_type.startswith(FORM):
            data = {k: v.encode() for k, v in parse_qsl(body.decode("utf-8", "replace"),
                                                         keep_blank_values=True)} or data
        headers = {k: v for k, v in request.headers.items() if k != "authorization"}
        headers |= {"body": {"content-type": content_type},
                    "url_path": request.path_params.get("path", "")}
        uid, event, queue = str(uuid.uuid4()), asyncio.Event(), deque()
        self.response_buffer[uid] = ResponseBufferItem(event=event, response_queue=queue)
        messages = self._messages(uid, queue, event)
        try:
            self.request_queue.put((self.response_queue_id, uid, time.monotonic(),
                                    (data, headers)))
            kind, status, answer_headers, media, first = await anext(messages)
        except BaseException:
            await messages.aclose()
            self.response_buffer.pop(uid, None)
            raise
        if kind == "end":
            await messages.aclose()
            return Response(first, status, answer_headers, media_type=media or JSON)
        return StreamingResponse(_chain(first, messages), status, answer_headers,
                                 media_type=media or JSON)

    async def _messages(self, uid: str, queue: deque, event: asyncio.Event
                        ) -> AsyncIterator[Message]:
        """The worker's messages for request `uid`, up to its "end"."""
        try:
            while True:
                await event.wait()
                event.clear()
                while queue:
                    message, status = queue.popleft()
                    if status == LitAPIStatus.ERROR:  # LitServe's own failure, not ours
                        message = ("end", 500, {}, JSON,
                                   json.dumps(error_body(500, "worker error")).encode())
                    yield message
                    if message[0] == "end":
                        return
        finally:
            self.response_buffer.pop(uid, None)


async def _chain(first: bytes, messages: AsyncIterator[Message]) -> AsyncIterator[bytes]:
    yield first
    async for message in messages:
        yield message[4]


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; past `limit` bytes a 413 (once the body is read, so the client
    gets the answer rather than a reset connection)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise HTTPException(413, f"request of {size} bytes: more than max_request_size "
                                 f"({limit})")
    return b"".join(chunks)
