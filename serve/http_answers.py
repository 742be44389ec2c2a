"""What a handler reads from a request's body and may put in an HTTP answer (shipped in every
archive; no compress imports).

TorchServe 0.12 frames the reason phrase with its length in characters but writes its UTF-8
bytes, so a phrase with a non-ASCII character (an unknown field's name, echoed in a 400)
broke the frame: the frontend read a 2 GB "message" and dropped the worker with every
request in flight (found by fuzzing). HTTP reason phrases are ASCII anyway.

A body is read for one request alone: whatever it holds (JSON nested past Python's
recursion limit, an integer of more digits than `int` converts, a lone surrogate) is a
ValueError, whose message goes back with a 400 for that request only. An answer is strict
JSON: NaN and Infinity, which Python's `json` writes by default, are no JSON."""

from __future__ import annotations

import json
from typing import Any

MAX_PHRASE = 200


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
