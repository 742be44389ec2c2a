"""Issue 39 items 1 and 2: the classifier handler answers a bad request alone. Each batch
mixes good bodies with one of each bad kind (lone or split surrogates, JSON nested 100,000
deep, NaN and Infinity, numbers no float holds, invalid UTF-8, an empty body), handed to the
handler as each engine hands it over: TorchServe's worker decodes a JSON body first (its own
`_retrieve_input_data`), LitServe passes the bytes. Only the bad ones get a 4xx; every good
one gets the answer it gets alone, as strict JSON. Runs in this process on tiny TorchScript
models (a 2-layer BERT, an 8x8-image linear model)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("ts")

from ts.context import Context, RequestProcessor  # noqa: E402
from ts.protocol.otf_message_handler import _retrieve_input_data  # noqa: E402

from serve.classifier.handler import CompressHandler  # noqa: E402

JSON = "application/json"
ENGINES = ("torchserve", "litserve")
PLAIN = "text/plain; charset=utf-8"
GOOD_TEXTS = [b'{"text": "a good movie"}', b'{"texts": ["awful film", "superb"]}',
              b'"a JSON string"', b'{"text": "the plot is poor but \\ud83d\\ude00"}',
              (b"warm and happy story \xf0\x9f\x98\x80", PLAIN)]
DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_TEXTS = {
    "lone surrogate": b'{"text": "\\ud800"}',
    "lone low surrogate": b'{"text": "ok \\udfff"}',
    "split surrogate pair": b'{"texts": ["good \\ud83d", "\\ude00 film"]}',
    "reversed surrogate pair": b'{"text": "\\ude00\\ud83d"}',
    "nested 100,000 deep": DEEP,
    "text nested 100,000 deep": b'{"text": ' + DEEP + b"}",
    "NaN text": b'{"text": NaN}',
    "Infinity text": b'{"texts": [Infinity]}',
    "huge number": b'{"text": 1e999}',
    "number of 5000 digits": b'{"text": ' + b"9" * 5000 + b"}",
    "invalid UTF-8": b'{"text": "\xff\xfe bad"}',
    "UTF-8 encoded surrogate": b'{"text": "\xed\xa0\x80"}',
    "empty body": b"",
    "empty text": b'{"text": ""}',
    "JSON null": b"null",
}
IMAGE = [[[0.25 * ((r + c) % 4) for c in range(8)] for r in range(8)]]
GOOD_IMAGES = [json.dumps({"input": IMAGE}).encode(),
               json.dumps({"inputs": [IMAGE, [[[1.0] * 8] * 8]]}).encode()]
BAD_IMAGES = {
    "NaN input": json.dumps({"input": [[[float("nan")] * 8] * 8]}).encode(),
    "Infinity input": json.dumps({"inputs": [IMAGE, [[[float("inf")] * 8] * 8]]}).encode(),
    "-Infinity input": json.dumps({"input": [[[-float("inf")] * 8] * 8]}).encode(),
    "1e999 input": b'{"input": [[' + b", ".join([b"[" + b", ".join([b"1e999"] * 8) + b"]"] * 8)
                   + b"]]}",
    "integer past float": b'{"input": [[[' + str(10**400).encode() + b"]]]}",
    "nested 100,000 deep": DEEP,
    "input nested 100,000 deep": b'{"input": ' + DEEP + b"}",
    "strings": b'{"input": [[["a"]]]}',
    "lone surrogate": b'{"input": "\\ud800"}',
    "invalid UTF-8": b"\xff\xfe",
    "empty body": b"",
}


class _Socket:
    """The frontend's side of a worker socket: recv() hands out one frame's bytes."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def recv(self, n: int) -> bytes:
        chunk = self.data[self.at:self.at + n]
        self.at += len(chunk)
        return chunk


def torchserve_value(body: bytes, content_type: str) -> Any:
    """The body as TorchServe's worker hands it to a handler (JSON decoded where it can)."""
    frame = b"".join(struct.pack("!i", len(part)) + part
                     for part in (b"body", content_type.encode(), body))
    return _retrieve_input_data(_Socket(frame))["value"]


Body = bytes | tuple[bytes, str]  # a JSON body, or (body, content type)


def serve_batch(handler: CompressHandler, bodies: list[Body], engine: str
                ) -> list[tuple[int, Any]]:
    """(status, answer) of each body served in one batch as `engine` serves it; a handler
    that raises fails the whole batch as the engine does (TorchServe 503, LitServe 500)."""
    typed = [body if isinstance(body, tuple) else (body, JSON) for body in bodies]
    if engine == "torchserve":
        requests = [{"body": torchserve_value(b, kind)} for b, kind in typed]
    else:
        requests = [{"body": b} for b, _ in typed]
    context = Context("m", "", None, len(bodies), None, "0.12.0")
    context.request_processor = [RequestProcessor({"body": {"content-type": kind}})
                                 for _, kind in typed]
    try:
        answers = handler.handle(requests, context)
    except Exception:  # noqa: BLE001 (the engine's answer to a failed batch)
        return [(503 if engine == "torchserve" else 500, None)] * len(bodies)
    assert len(answers) == len(bodies)
    return [(context.get_response_status(i)[0], strict_json(a)) for i, a in enumerate(answers)]


def strict_json(text: str) -> Any:
    """`text` as JSON, refusing NaN and Infinity (which no JSON parser but Python's takes)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in an answer: not JSON")

    return json.loads(text, parse_constant=refuse)


def _write_export(folder: Path, module: torch.nn.Module, example: tuple, meta: dict,
                  labels: list[str]) -> Path:
    folder.mkdir(parents=True)
    with torch.no_grad():
        traced = torch.jit.trace(module.eval(), example, strict=False, check_trace=False)
    traced.save(str(folder / "model.pt"))
    (folder / "export.json").write_text(json.dumps(
        {"format": "torchscript", "file": "model.pt", "outputs": ["logits"], **meta}))
    (folder / "index_to_name.json").write_text(json.dumps(dict(enumerate(labels))))
    return folder


def load_handler(folder: Path) -> CompressHandler:
    """The handler initialised on `folder` as a TorchServe worker does it."""
    config = {"maxWorkers": 1, "batchSize": 8,
              "handler": {"threads": 1, "max_length": 32, "max_text_chars": 200}}
    context = Context("m", str(folder), None, 8, None, "0.12.0", model_yaml_config=config)
    handler = CompressHandler()
    handler.initialize(context)
    return handler


@pytest.fixture(scope="module")
def text_handler(tiny_bert: Path, tmp_path_factory) -> CompressHandler:
    """The handler on tiny_bert traced to TorchScript, with its tokenizer."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    from export.graphs import TextLogits

    folder = tmp_path_factory.mktemp("text_export") / "export"
    model = TextLogits(BertForSequenceClassification.from_pretrained(tiny_bert))
    ids = torch.tensor([[101, 2204, 3185, 7592, 102], [101, 2919, 102, 0, 0],
                        [101, 2204, 102, 0, 0]])
    example = (ids, (ids > 0).long(), torch.zeros_like(ids))
    _write_export(folder, model, example, {"text": True, "inputs": [
        "input_ids", "attention_mask", "token_type_ids"]}, ["negative", "positive"])
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(folder)
    return load_handler(folder)


@pytest.fixture(scope="module")
def image_handler(tmp_path_factory) -> CompressHandler:
    """The handler on a linear 10-class model of 1x8x8 images."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    folder = tmp_path_factory.mktemp("image_export") / "export"
    _write_export(folder, model, (torch.rand(2, 1, 8, 8),),
                  {"text": False, "inputs": ["input"], "input_shape": [1, 8, 8]},
                  [str(i) for i in range(10)])
    return load_handler(folder)


def _probabilities(answer: Any) -> list[list[float]]:
    rows = answer if isinstance(answer, list) else [answer]
    return [list(row["probabilities"].values()) for row in rows]


def assert_alone_answers(handler, goods: list[Body], bads: list[Body], engine: str) -> None:
    """Goods and bads interleaved in one batch: each bad one a 400, each good one 200 with
    its alone-answer (probabilities within 1e-5, the same labels)."""
    alone = {good: serve_batch(handler, [good], engine)[0] for good in dict.fromkeys(goods)}
    assert [status for status, _ in alone.values()] == [200] * len(alone)
    mixed = [body for pair in zip(goods * len(bads), bads, strict=False) for body in pair]
    mixed += goods[len(bads):] if len(bads) < len(goods) else []
    answers = serve_batch(handler, mixed, engine)
    for body, (status, answer) in zip(mixed, answers, strict=True):
        if body in bads:
            assert status == 400 and answer["status"] == 400, (body, status, answer)
            continue
        assert status == 200, (body, status, answer)
        expected = alone[body][1]
        got, want = _probabilities(answer), _probabilities(expected)
        assert [len(r) for r in got] == [len(r) for r in want]
        assert max(abs(g - w) for gr, wr in zip(got, want, strict=True)
                   for g, w in zip(gr, wr, strict=True)) <= 1e-5
        labels = [a["label"] for a in (answer if isinstance(answer, list) else [answer])]
        assert labels == [a["label"] for a in
                          (expected if isinstance(expected, list) else [expected])]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", sorted(BAD_TEXTS))
def test_a_bad_text_request_is_a_400_alone(text_handler, engine: str, kind: str) -> None:
    assert_alone_answers(text_handler, GOOD_TEXTS, [BAD_TEXTS[kind]], engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_bad_text_kind_in_one_batch(text_handler, engine: str) -> None:
    bads = list(BAD_TEXTS.values())
    assert_alone_answers(text_handler, GOOD_TEXTS * 4, bads, engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", sorted(BAD_IMAGES))
def test_a_bad_image_request_is_a_400_alone(image_handler, engine: str, kind: str) -> None:
    assert_alone_answers(image_handler, GOOD_IMAGES, [BAD_IMAGES[kind]], engine)


def test_non_finite_inputs_are_refused_with_their_reason(image_handler) -> None:
    for engine in ENGINES:
        (status, answer), = serve_batch(image_handler, [BAD_IMAGES["NaN input"]], engine)
        assert status == 400 and "NaN or infinity" in answer["error"]


def test_a_surrogate_is_refused_with_its_reason(text_handler) -> None:
    for engine in ENGINES:
        (status, answer), = serve_batch(text_handler, [BAD_TEXTS["lone surrogate"]], engine)
        assert status == 400 and "surrogate" in answer["error"]
        (status, answer), = serve_batch(text_handler, [BAD_TEXTS["nested 100,000 deep"]],
                                        engine)
        assert status == 400 and answer["error"] == "malformed JSON: nested too deeply"


def test_a_tokenizer_failure_fails_its_request_alone(text_handler, monkeypatch) -> None:
    tokenizer = text_handler.tokenizer

    def check(texts) -> None:
        if any("boom" in t for t in ([texts] if isinstance(texts, str) else texts)):
            raise RuntimeError("the tokenizer broke")

    class FussyRust:
        """The real Rust tokenizer, which raises on any text holding "boom"."""

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer.backend_tokenizer, name)

        def encode_batch_fast(self, texts, *args, **kwargs):
            check(texts)
            return tokenizer.backend_tokenizer.encode_batch_fast(texts, *args, **kwargs)

        encode_batch = encode_batch_fast

    class Fussy:
        """The real tokenizer, which raises on any text holding "boom" (called, or through
        its Rust tokenizer as token_rows reads a fast one)."""

        backend_tokenizer = FussyRust()

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def __call__(self, texts, *args, **kwargs):
            check(texts)
            return tokenizer(texts, *args, **kwargs)

    monkeypatch.setattr(text_handler, "tokenizer", Fussy())
    assert_alone_answers(text_handler, GOOD_TEXTS, [b'{"text": "boom"}'], "litserve")


def test_a_forward_failure_fails_its_request_alone(image_handler, monkeypatch) -> None:
    """A row that makes the model raise (here: any 7.0) is answered 500 alone: the batch
    is run again one request at a time."""
    forward = image_handler.forward

    def fussy(x: torch.Tensor) -> torch.Tensor:
        if (x == 7.0).any():
            raise RuntimeError("the model broke")
        return forward(x)

    monkeypatch.setattr(image_handler, "forward", fussy)
    poisoned = json.dumps({"input": [[[7.0] * 8] * 8]}).encode()
    answers = serve_batch(image_handler, [GOOD_IMAGES[0], poisoned, GOOD_IMAGES[1]],
                          "litserve")
    assert [status for status, _ in answers] == [200, 500, 200]
    assert answers[1][1] == {"error": "prediction failed", "status": 500}
    monkeypatch.setattr(image_handler, "forward", forward)
    alone = serve_batch(image_handler, [GOOD_IMAGES[0], GOOD_IMAGES[1]], "litserve")
    for (_, got), (_, want) in zip([answers[0], answers[2]], alone, strict=True):
        assert torch.allclose(torch.tensor(_probabilities(got)),
                              torch.tensor(_probabilities(want)), atol=1e-6)


def test_a_non_finite_answer_is_a_422_alone_and_strict_json(image_handler,
                                                            monkeypatch) -> None:
    """Finite inputs the model cannot answer with finite numbers (here: rows holding 3e38,
    whose logits overflow) get a 422 each; the others their answer, as strict JSON."""
    forward = image_handler.forward
    monkeypatch.setattr(image_handler, "forward", lambda x: forward(x) * x.amax((1, 2, 3))[:, None])
    huge = json.dumps({"input": [[[3e38] * 8] * 8]}).encode()
    answers = serve_batch(image_handler, [GOOD_IMAGES[0], huge], "litserve")
    assert [status for status, _ in answers] == [200, 422]
    assert "not a finite number" in answers[1][1]["error"]
    assert all(math.isfinite(p) for p in answers[0][1]["probabilities"].values())


@pytest.mark.parametrize("body", [b'"{"', b'"{\\"text\\": \\"a fine film\\"}"',
                                  b'"[\\"awful\\", \\"superb\\"]"'])
def test_a_json_string_that_looks_like_json_is_one_text_on_both_engines(
        text_handler, body: bytes) -> None:
    """Issue 70 (found by the served property test's oracle): a JSON body that is a string
    is that string, the text to classify, on both engines. TorchServe's worker hands it over
    decoded; the handler parsed the decoded string again where it began with `{` or `[`
    (`"{"` was a 400 on TorchServe and a 200 on LitServe)."""
    text = json.loads(body)
    expected = serve_batch(text_handler, [json.dumps({"text": text}).encode()], "litserve")
    assert expected[0][0] == 200
    for engine in ENGINES:
        (status, answer), = serve_batch(text_handler, [body], engine)
        assert status == 200, (engine, answer)
        assert _probabilities(answer)[0] == pytest.approx(_probabilities(expected[0][1])[0],
                                                       abs=1e-6)
