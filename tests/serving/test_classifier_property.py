"""Issues 39 and 70: the classifier's property, on TorchServe, LitServe and Ray Serve
(tiny_onnx: batch size 8, 50 ms delay, 200 characters a text, 64 texts a request). Two
strategies:

- *valid but odd* requests: any valid Unicode text (control characters, emoji, right to
  left, 200 characters), as `{"text"}`, `{"texts": [1..64]}`, a JSON string, a plain-text or
  octet-stream body, a form field. Each gets 200 and exactly the answer it gets alone
  (probabilities within 1e-5).
- *arbitrary* bodies (any bytes, any JSON value at any nesting, lone surrogates, NaN,
  numbers past float; under any of four content types). `text_body_valid`, a small oracle
  written from the handler's documented contract, says which of them happen to be valid:
  those get 200 and their alone answer, all others a 4xx.

Each case is sent at the same moment as three good requests; the round is sent again until
the generated request's `X-Batch-Size` shows that it shared a batch (`served_property`).
Every good request gets exactly the answer it gets alone. A probe thread sends a plain
request every 0.25 s throughout: each answered 200 within 1 s.

One exception, outside the handler: TorchServe's Java frontend decodes form-urlencoded bodies
itself (Netty's HttpPostRequestDecoder) and answers a malformed one (`{"&&": 1}`: "empty
name") with its own 500 before any handler runs. That request still fails alone; the test
accepts exactly that frontend answer and nothing else.

Generated cases per engine: COMPRESS_PROPERTY_EXAMPLES (default 25, what CI runs), asserted
apart from the named @examples; `benchmarks/soak/run.py --property-examples` sets it high.
Each run prints its tally ("property cases (classifier, ENGINE): ...")."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

pytest.importorskip("ts")
pytest.importorskip("hypothesis")

from conftest import EVERY_ENGINE, engine_fixture  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from served_property import (  # noqa: E402
    Probe,
    Tally,
    beside_goods,
    examples,
    frontend_form_refusal,
    post,
    run_property,
    text_body_valid,
)

pytestmark = pytest.mark.serving
engine = engine_fixture(EVERY_ENGINE)

EXAMPLES = examples(25)
MAX_CHARS, MAX_ITEMS = 200, 64  # the archive's limits (conftest's packaged_text_run)
JSON = "application/json"
PLAIN, OCTETS = "text/plain", "application/octet-stream"
FORM = "application/x-www-form-urlencoded"
CONTENT_TYPES = (JSON, PLAIN, OCTETS, FORM)
GOOD = [b'{"text": "great lovely movie"}', b'{"texts": ["awful dull film", "superb"]}',
        b'{"text": "the plot is poor but the actors are warm"}']
DEEP = b"[" * 100_000 + b"]" * 100_000

# any character, lone surrogates included (hypothesis leaves them out of text by default)
CHARACTERS = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr))
TEXTS = st.lists(CHARACTERS, max_size=40).map("".join)
SCALARS = st.one_of(st.none(), st.booleans(), st.floats(), TEXTS,
                    st.integers(-(10**400), 10**400),
                    st.sampled_from([1e308, -1e308, 2**63, -(2**64), 3.4e38, 0.0]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(TEXTS, inner, max_size=4), max_leaves=30)
SHAPED = st.one_of(  # what the handler looks for, holding anything
    st.fixed_dictionaries({"text": VALUES}),
    st.fixed_dictionaries({"texts": st.lists(VALUES, max_size=70)}),
    st.fixed_dictionaries({"input": VALUES}), st.fixed_dictionaries({"inputs": VALUES}),
    VALUES)


def _as_json(value: object, ascii_only: bool) -> bytes:
    """`value` as JSON bytes: lone surrogates as \\u escapes, or (not ascii_only) as the
    bytes UTF-8 would give them, which no UTF-8 decoder takes."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


RAW = st.one_of(  # bodies no JSON writer makes
    st.binary(max_size=300),
    st.integers(1, 120_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 120_000).map(lambda n: b'{"text": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(1, 6000).map(lambda n: b'{"text": ' + b"9" * n + b"}"),
    st.sampled_from([b"", b" ", b"NaN", b'{"text": NaN}', b'{"text": -Infinity}', b"{",
                     b'{"text": "\\ud83d"}', b'"\\ude00"', b"text=\xff", b"text=%ED%A0%80"]))
ARBITRARY = st.tuples(st.one_of(st.builds(_as_json, SHAPED, st.booleans()), RAW),
                      st.sampled_from(CONTENT_TYPES))

# valid Unicode text that is not blank: controls, emoji, combining marks, right to left
ODD_CHARACTERS = st.characters(exclude_categories=["Cs"])
ODD_TEXT = st.one_of(
    st.text(ODD_CHARACTERS, min_size=1, max_size=MAX_CHARS),
    st.sampled_from(["\x00a", " \t x \n", "é" * MAX_CHARS, "😀" * 50, "שלום עולם",
                     "e\u0301\u0302\u0303", "\u200b\u200d x", "a" * MAX_CHARS, "{", "[1]"]),
).filter(str.strip)


def _plain(text: str) -> bool:
    """Whether a plain-text body reads as that text (one that looks like JSON is parsed)."""
    return text.lstrip()[:1] not in ("{", "[")


ODD = st.one_of(
    st.builds(lambda t, a: (_as_json({"text": t}, a), JSON), ODD_TEXT, st.booleans()),
    st.builds(lambda ts, a: (_as_json({"texts": ts}, a), JSON),
              st.lists(ODD_TEXT, min_size=1, max_size=MAX_ITEMS), st.booleans()),
    st.builds(lambda t, a: (_as_json(t, a), JSON), ODD_TEXT, st.booleans()),
    st.builds(lambda t, kind: (t.encode(), kind), ODD_TEXT.filter(_plain),
              st.sampled_from([PLAIN, OCTETS])),
    st.builds(lambda t: (b"text=" + quote(t).encode(), FORM), ODD_TEXT),
)
CASES = st.one_of(st.tuples(ODD, st.just("odd")), st.tuples(ARBITRARY, st.just("arbitrary")))


def _probabilities(answer: bytes) -> list[list[float]]:
    rows = json.loads(answer)
    rows = rows if isinstance(rows, list) else [rows]
    return [list(row["probabilities"].values()) for row in rows]


def same(got: bytes, want: list[list[float]]) -> bool:
    """Whether an answer's probabilities are `want`'s (within 1e-5, row for row)."""
    rows = _probabilities(got)
    return [len(r) for r in rows] == [len(r) for r in want] and all(
        abs(g - w) <= 1e-5 for gr, wr in zip(rows, want, strict=True)
        for g, w in zip(gr, wr, strict=True))


@pytest.fixture(scope="module")
def alone(served: dict) -> list[list[list[float]]]:
    """Each good request's probabilities when it is sent alone."""
    answers = []
    for body in GOOD:
        answer = post(served, "", body)
        assert answer.status == 200, answer.body
        answers.append(_probabilities(answer.body))
    return answers


def test_any_body_fails_alone_and_odd_valid_ones_answer_as_alone(
        served: dict, alone: list, engine: str) -> None:
    tally = Tally()
    plain = Probe(lambda: post(served, "", b'{"text": "a fine film"}'))

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=CASES, generated=st.just(True))
    @example(case=((b'{"text": "\\ud800"}', JSON), "arbitrary"), generated=False)
    @example(case=((b'{"texts": ["good \\ud83d", "\\ude00 movie"]}', JSON), "arbitrary"),
             generated=False)
    @example(case=((b'{"text": "\\ude00\\ud83d"}', JSON), "arbitrary"), generated=False)
    @example(case=((DEEP, JSON), "arbitrary"), generated=False)
    @example(case=((b'{"text": ' + DEEP + b"}", JSON), "arbitrary"), generated=False)
    @example(case=((b'{"text": NaN}', JSON), "arbitrary"), generated=False)
    @example(case=((b'{"input": [[NaN, Infinity]]}', JSON), "arbitrary"), generated=False)
    @example(case=((b'{"text": "\xff\xfe"}', JSON), "arbitrary"), generated=False)
    @example(case=((b'{"text": ' + b"9" * 5000 + b"}", JSON), "arbitrary"), generated=False)
    @example(case=((b"", JSON), "arbitrary"), generated=False)
    @example(case=((b"&", FORM), "arbitrary"), generated=False)  # a form without fields
    @example(case=((b'{"text": ""}', JSON), "arbitrary"), generated=False)
    @example(case=((b"{}", JSON), "arbitrary"), generated=False)
    @example(case=((b'{"text": {"&&": null}}', FORM), "arbitrary"), generated=False)
    @example(case=((b'"{"', JSON), "odd"), generated=False)  # a JSON string: that text
    @example(case=((b"text=%F0%9F%98%80", FORM), "odd"), generated=False)
    def check(case: tuple[tuple[bytes, str], str], generated: bool) -> None:
        (body, content_type), kind = case
        valid = text_body_valid(body, content_type, MAX_CHARS, MAX_ITEMS)
        assert valid or kind != "odd", ("the odd strategy drew an invalid body", body[:200])
        want = None
        if valid:  # its answer alone
            first = post(served, "", body, content_type)
            assert first.status == 200, (body[:200], first.status, first.body[:300])
            want = _probabilities(first.body)
        place = (tally.generated + tally.named) % (len(GOOD) + 1)  # first, second, ...

        mine, goods = beside_goods(
            [lambda good=good: post(served, "", good) for good in GOOD],
            lambda: post(served, "", body, content_type), place, tally,
            lambda answer: frontend_form_refusal(engine, content_type, answer))
        verdict = "valid" if valid else "invalid"
        tally.count(generated, kind if kind == "odd" else f"arbitrary {verdict}", mine.status)
        if valid:
            assert mine.status == 200, (body[:200], content_type, mine.status, mine.body[:300])
            assert same(mine.body, want), (body[:200], content_type)
            tally.compared += 1
        else:
            assert 400 <= mine.status < 500 or frontend_form_refusal(
                engine, content_type, mine), (body[:200], content_type, mine.status,
                                              mine.body[:300])
        for answer, expected in zip(goods, alone, strict=True):
            assert answer.status == 200, (body[:200], answer.status, answer.body[:300])
            assert same(answer.body, expected), body[:200]

    run_property(check, tally, plain, "classifier", engine, EXAMPLES)
