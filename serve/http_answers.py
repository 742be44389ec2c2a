"""What a handler reads from a request's body and may put in an HTTP answer (shipped in every
archive; no compress imports).

TorchServe 0.12 frames the reason phrase with its length in characters but writes its UTF-8
bytes, so a phrase with a non-ASCII character (an unknown field's name, echoed in a 400)
broke the frame: the frontend read a 2 GB "message" and dropped the worker with every
request in flight (found by fuzzing). HTTP reason phrases are ASCII anyway.

A body is read for one request alone: whatever it holds (JSON nested past Python's
recursion limit, an integer of more digits than `int` converts, a lone surrogate) is a
ValueError, whose message goes back with a 400 for that request only. An answer is strict
JSON: NaN and Infinity, which Python's `json` writes by default, are no JSON. On OpenAI's
routes an error is OpenAI's error object."""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)
MAX_PHRASE = 200
NO_BODY = ('no request body: send {"text": "..."} as application/json, or the text itself '
           "as text/plain")


def reason_phrase(message: str) -> str:
    """`message` as a reason phrase: printable ASCII (others escaped), one line, bounded."""
    escaped = message.encode("ascii", "backslashreplace").decode("ascii")
    line = "".join(c if " " <= c <= "~" else " " for c in escaped)
    return line[:MAX_PHRASE]


def load_json(body: str) -> Any:
    """The JSON value of a body (None when blank); ValueError when malformed or too deep."""
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("malformed JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
        raise ValueError(f"malformed JSON: {exc}") from None


def check_unicode(text: str) -> None:
    """ValueError when `text` holds a lone surrogate (a JSON escape such as "\\ud800", or
    half of a split pair): it is no Unicode text, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise ValueError(f"the text is not valid Unicode: a lone surrogate \\u{code:04x} at "
                         f"character {exc.start} (send surrogate pairs whole)") from None


def json_answer(value: Any) -> str:
    """`value` as strict JSON (ValueError on NaN or Infinity, which JSON has no words for)."""
    return json.dumps(value, allow_nan=False)


def read_body(request: dict[str, Any], content_type: str) -> Any:
    """The value of one TorchServe request's body: JSON decoded (by TorchServe, or here where
    the content type says JSON or the text looks like JSON), else its text; a form field
    `text` (curl -d text=...) as `{"text": ...}`. ValueError: a 400 that says why."""
    body = request.get("body", request.get("data"))
    if body is None and "text" in request:  # a form field: curl -d text=...
        text = request["text"]
        body = {"text": bytes(text).decode("utf-8", "replace")
                if isinstance(text, bytes | bytearray) else text}
    if body is None:
        raise ValueError(NO_BODY)
    raw = isinstance(body, bytes | bytearray)
    if raw:
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the body is not UTF-8 text") from None
    # TorchServe's worker decodes an `application/json` body itself: a str it hands over
    # with that type is a JSON string, the text itself (LitServe hands over the bytes, parsed
    # here once: the same value); raw bytes are parsed where the content type says JSON, and
    # other text (plain text) where it looks like JSON
    decoded = not raw and content_type == "application/json"
    if isinstance(body, str) and ((raw and "json" in content_type)
                                  or (not decoded and body.lstrip()[:1] in "{[")):
        body = load_json(body)
    return body


def request_content_type(context: Any, idx: int, request: dict[str, Any]) -> str:
    """The content type of request `idx`'s body parameter ("" when unknown)."""
    name = "body" if "body" in request else "data"
    try:
        header = context.get_request_header(idx, name)
    except (AttributeError, IndexError, KeyError):
        return ""
    return (header or {}).get("content-type", "") if isinstance(header, dict) else ""


def refusal(exc: Exception) -> str:
    """The 400 message of one request's exception: a ValueError's own message, else its
    kind (the traceback goes to the log)."""
    if isinstance(exc, ValueError):
        return str(exc)
    logger.warning("a request could not be read", exc_info=exc)
    return f"the request could not be read ({type(exc).__name__})"


def openai_error(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = {400: "invalid_request_error", 401: "authentication_error",
            404: "not_found_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def openai_models(name: str) -> dict[str, Any]:
    """OpenAI's `GET v1/models`: the served model alone."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "compress"}]}
