"""An engine's error answers, in TorchServe's JSON (`{"code", "type", "message"}`).

An internal failure (the handler raised, the API server raised) answers a short message with
an error id; the traceback goes to the log under that id, never to the client. A stream that
has begun ends with an error line (`error_line`) in its own framing."""

from __future__ import annotations

import json
import logging
import traceback
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)
SSE = "text/event-stream"
ERROR_TYPES = {400: "BadRequestException", 401: "InvalidKeyException",
               404: "ModelNotFoundException", 405: "MethodNotAllowedException",
               413: "RequestTooLargeException", 503: "ServiceUnavailableException",
               504: "RequestTimeoutException"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """TorchServe's error object."""
    return {"code": status, "type": ERROR_TYPES.get(status, "InternalServerException"),
            "message": message}


def internal_error(what: str, exc: BaseException, log: logging.Logger = logger
                   ) -> dict[str, Any]:
    """A 500's body for `exc`: `what` failed, with an id; the traceback logged under it."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error id %s): %s", what, error_id,
              "".join(traceback.format_exception(exc)).rstrip())
    return error_body(500, f"{what} (error id {error_id}): the server's log has the details")


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's HTTPException (a bad token, an unknown path) as TorchServe answers it."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    return JSONResponse(error_body(status, str(detail)), status_code=status,
                        headers=getattr(exc, "headers", None))


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception in the API server: a 500 with an id, the traceback logged."""
    return JSONResponse(internal_error("the server failed", exc), status_code=500)


def error_line(media: str | None, status: int, message: str) -> bytes:
    """An error written into a stream that has begun: an SSE event, else an NDJSON line."""
    if media and media.startswith(SSE):
        error = {"message": message, "type": "server_error", "code": status}
        return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    return json.dumps({"error": message, "status": status}).encode() + b"\n"
