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
    # "b" was sent while the snowman's first bytes came (half a character hid that "b"
    # could begin the stop string), then the text was cut before it: deltas "\u00e9b"
    ("\u00e9b\u2603 x", ["b\u2603 "], "\u00e9"),
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


class Counting(Bytes):
    """Bytes, counting the tokens every decode call is handed."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(tokens)
        return super().decode(tokens, skip_special_tokens)


def test_a_long_row_is_decoded_incrementally() -> None:
    """Each token decodes a few tokens, not the whole row again (1.4 s for a 4,096-token
    row on the event loop when it did): the work grows linearly with the row."""
    tokenizer = Counting()
    stream = causal_lm_requests.TextStream(tokenizer, ["END"])
    data = ("na\u00efve caf\u00e9 \u2603 " * 400).encode()[:4096]
    deltas = "".join(stream.add(b) for b in data) + stream.flush()
    assert deltas == stream.text == data.decode("utf-8", errors="replace")
    assert tokenizer.decoded <= 8 * len(data), tokenizer.decoded


def test_a_real_tokenizers_deltas_add_up_to_its_decode(smol_tokenizer_llama_folder) -> None:
    """A byte-level BPE splits characters over tokens (half a character decodes to U+FFFD
    until its other bytes come); special tokens decode to nothing."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_llama_folder)
    text = ("Hello \U0001f600 world, \u4f60\u597d\u4e16\u754c! caf\u00e9 \u2603\u2603 "
            "  spaced   out\n\ttabs " * 6)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:40] + [tokenizer.eos_token_id] + ids[40:]
    stream = causal_lm_requests.TextStream(tokenizer, [])
    pieces = [stream.add(t) for t in ids]
    pieces.append(stream.flush())
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == stream.text == whole
    assert not any("\ufffd" in p for p in pieces)
