"""What a served LM streams (serve/causal_lm/requests.TextStream, serve/causal_lm/replies): the
deltas add up to the final text however generation ends, and an error after the first chunk is
framed as its stream's own kind of message."""

from __future__ import annotations

import json

import pytest

from serve.causal_lm.server import openai as openai_routes
from serve.causal_lm.server import requests as causal_lm_requests


class Bytes:
    """A tokenizer whose tokens are UTF-8 bytes (half a character decodes to U+FFFD)."""

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def streamed(text: str | bytes, stop: list[str]) -> tuple[str, causal_lm_requests.TextStream]:
    """(the deltas of a stream that ends after `text`, the stream)."""
    stream = causal_lm_requests.TextStream(Bytes(), stop)
    data = text.encode() if isinstance(text, str) else text
    pieces = [stream.add(b) for b in data if not stream.stopped]
    pieces.append(stream.flush())
    return "".join(pieces), stream


@pytest.mark.parametrize(("text", "stop", "want"), [
    ("Hello E", ["END"], "Hello E"),  # held back: "E" could begin "END"
    ("Hello END there", ["END"], "Hello "),  # the stop string ends the text
    ("ab", ["b", "bc"], "a"),
    ("caf\u00e9", [], "caf\u00e9"),
    (b"caf\xc3", [], "caf\ufffd"),  # ended by length mid-character: the text has U+FFFD
    ("x" * 70 + "ST", ["STOP"], "x" * 70 + "ST"),
])
def test_the_deltas_add_up_to_the_final_text(text, stop, want) -> None:
    deltas, stream = streamed(text, stop)
    assert stream.text == want and deltas == want


def test_a_flush_after_the_end_sends_nothing_twice() -> None:
    stream = causal_lm_requests.TextStream(Bytes(), ["END"])
    assert [stream.add(b) for b in b"Hi E"] == ["H", "i", " ", ""]
    assert stream.flush() == "E" and stream.flush() == ""


@pytest.mark.parametrize("openai", [True, False])
def test_an_error_after_the_first_chunk_is_framed_for_its_stream(openai) -> None:
    from ts.context import Context, RequestProcessor

    from serve.causal_lm.server import replies

    context = Context("tiny_lm", "", {}, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({})]
    body = replies.error(context, 0, "error: RuntimeError: broke", 500, openai=openai,
                         streamed=True)
    if openai:
        assert body.startswith("data: ") and body.endswith("\n\n")
        assert json.loads(body[len("data: "):]) == openai_routes.error(
            "error: RuntimeError: broke", 500)
    else:
        assert body.endswith("\n") and json.loads(body) == {
            "error": "error: RuntimeError: broke", "status": 500}
