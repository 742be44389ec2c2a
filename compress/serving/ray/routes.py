"""TorchServe's URLs for one model as a replica's FastAPI app (the ASGI app Ray Serve's
proxy hands requests to): `POST|PUT|GET /predictions/MODEL[/VERSION[/PATH]]` (PATH: the
handler's own routes, e.g. `v1/chat/completions`) and `/ping`, with LitServe's answers.

The body (at most `max_request_size` bytes, else 413; an urlencoded form one entry a field)
goes to the handler as TorchServe hands it over, with the request's headers (the token
left out), the body's content type and `url_path`. The answer waits for the handler's first
message: the whole answer, or the first chunk of a stream, whose status and headers are
those the handler set before sending it. Past `responseTimeout` without a message a request
gets a 504 (an error line once a stream has begun, as a failure mid-stream does); its
handler task is cancelled, as it is when its client leaves.

Every answer names the replica and the node that gave it (`X-Compress-Replica`,
`X-Compress-Node`). Errors outside the handler are TorchServe's JSON.

A replica whose process dies cannot answer for its requests: Ray Serve's proxy (on the head)
then answers uvicorn's plain-text 500 before an answer began, and cuts a stream that had
begun without the chunked body's last chunk. `LostReplica`, a middleware in the proxy itself
(`proxy_middlewares`, named on every head compress starts: `cluster.PROXY_HOOK`; on a
cluster of one's own, `ray start --head` in an environment where
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names it), answers TorchServe's JSON 500 instead,
and ends such a stream with an error line, as a handler failing mid-stream does. Neither
is retried: the request may have run, and may not be idempotent."""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from compress.serving.handler_host.body import handler_request
from compress.serving.handler_host.errors import (
    error_body,
    error_line,
    http_error,
    unexpected_error,
)
from compress.serving.handler_host.handler import TOKEN_FAILED, token_digest
from compress.serving.ray.runner import CHUNK, FAIL, Call, HandlerRunner

JSON = "application/json"
REPLICA_HEADER, NODE_HEADER = "X-Compress-Replica", "X-Compress-Node"


def check_token(authorization: str, digest: str | None) -> None:
    """TorchServe's token check against the token's digest (a 401 unless it matches)."""
    if digest is None:
        return
    scheme, _, value = authorization.partition(" ")
    given = token_digest(value.strip())
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, digest):
        raise HTTPException(401, TOKEN_FAILED)


class ReplicaHeaders:
    """ASGI middleware: each answer's headers name the replica and node that gave it."""

    def __init__(self, app: Any, replica: str, node: str) -> None:
        self.app = app
        self.extra = [(REPLICA_HEADER.lower().encode(), replica.encode()),
                      (NODE_HEADER.lower().encode(), node.encode())]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.extra]}
            await send(message)

        await self.app(scope, receive, named)


class LostReplica:
    """ASGI middleware of Ray Serve's proxy: an answer the proxy left unstarted (a 500
    without a body: the replica was lost, or the proxy failed) is TorchServe's JSON 500; a
    chunked answer it left unfinished (a stream whose replica was lost) ends with an error
    line in its own framing (SSE or NDJSON), then its last chunk. An answer of a known
    length left unfinished is left to uvicorn, which closes the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began: dict[bytes, bytes] | None = None
        ended = False

        async def watched(message: dict[str, Any]) -> None:
            nonlocal began, ended
            if message["type"] == "http.response.start":
                began = {k.lower(): v for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        await self.app(scope, receive, watched)
        if ended:
            return
        if began is None:
            body = json.dumps(error_body(500, LOST)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", JSON.encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif b"content-length" not in began:
            media = began.get(b"content-type", b"").decode("latin-1")
            await send({"type": "http.response.body",
                        "body": error_line(media, 500, LOST_STREAM)})


LOST = ("no answer from the replica: it was lost (its process or node died), or Ray Serve's "
        "proxy failed (its log says which); the request was not retried (it may have run)")
LOST_STREAM = "the replica serving this stream was lost (its process or node died)"


def proxy_middlewares() -> list[Any]:
    """Ray Serve's proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): `LostReplica`."""
    from starlette.middleware import Middleware

    return [Middleware(LostReplica)]


def build_app(runner: HandlerRunner, model_name: str, version: str | None,
              digest: str | None, max_request_size: int, timeout_s: float,
              replica: str, node: str) -> FastAPI:
    """The replica's app for `model_name` (its handler behind `runner`)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)

    async def ping() -> JSONResponse:
        return JSONResponse({"status": "Healthy"})

    async def predict(request: Request) -> Response:
        check_token(request.headers.get("authorization", ""), digest)
        data, headers = await handler_request(request, model_name, version, max_request_size)
        call = Call(str(uuid.uuid4()), data, headers)
        del data
        running = runner.submit(call)
        try:
            kind, status, answer_headers, media, first = await asyncio.wait_for(
                call.messages.get(), timeout_s)
        except TimeoutError:
            call.cancel()
            return JSONResponse(error_body(504, f"no answer within responseTimeout "
                                                f"({timeout_s:g} s)"), status_code=504)
        except BaseException:  # the client left: Ray Serve cancels its request
            call.cancel()
            raise
        if kind != CHUNK:
            return Response(first, status, answer_headers, media_type=media or JSON)
        return StreamingResponse(_stream(first, call, running, media, timeout_s),
                                 status_code=status, headers=answer_headers,
                                 media_type=media or JSON)

    base = f"/predictions/{model_name}"
    app.add_api_route("/ping", ping, methods=["GET"])
    for path in ("", "/{version}", "/{version}/{path:path}"):
        app.add_api_route(base + path, predict, methods=["GET", "POST", "PUT"])
    app.add_middleware(ReplicaHeaders, replica=replica, node=node)
    return app


async def _stream(first: bytes, call: Call, running: asyncio.Future, media: str | None,
                  timeout_s: float) -> AsyncIterator[bytes]:
    """A stream's bytes up to the handler's last message; a timeout ends it with an error
    line; however it ends (the client left too), the request's task is cancelled."""
    yield first
    try:
        while True:
            try:
                kind, status, _, _, data = await asyncio.wait_for(call.messages.get(),
                                                                  timeout_s)
            except TimeoutError:
                yield error_line(media, 504, f"no answer within responseTimeout "
                                             f"({timeout_s:g} s)")
                return
            if kind == FAIL:  # the handler raised: an error line, never a silent cut
                yield error_line(media, status, json.loads(data).get("message", "failed"))
                return
            if data:
                yield data
            if kind != CHUNK:
                return
    finally:
        call.cancel()
        if running.done() and not running.cancelled():
            running.exception()  # retrieved: a failure is the handler's, answered above

