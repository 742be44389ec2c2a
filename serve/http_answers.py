"""What a handler may put in an HTTP answer's status line (shipped in every archive; no
compress imports).

TorchServe 0.12 frames the reason phrase with its length in characters but writes its UTF-8
bytes, so a phrase with a non-ASCII character (an unknown field's name, echoed in a 400)
broke the frame: the frontend read a 2 GB "message" and dropped the worker with every
request in flight (found by fuzzing). HTTP reason phrases are ASCII anyway."""

from __future__ import annotations

MAX_PHRASE = 200


def reason_phrase(message: str) -> str:
    """`message` as a reason phrase: printable ASCII (others escaped), one line, bounded."""
    escaped = message.encode("ascii", "backslashreplace").decode("ascii")
    line = "".join(c if " " <= c <= "~" else " " for c in escaped)
    return line[:MAX_PHRASE]
