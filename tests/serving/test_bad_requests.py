"""Issue 39 acceptance: sixteen simultaneous requests to the tiny packaged BERT (tiny_onnx:
batch size 8, 50 ms delay), one of each bad kind among good ones, three rounds, on
TorchServe, LitServe and Ray Serve: every good one is answered 200 with its label (the one it gets
alone), every bad one a 4xx. Before issue 39 a lone surrogate, a split surrogate pair or
JSON nested 100,000 deep failed the whole batch (TorchServe 503, LitServe 500)."""

from __future__ import annotations

import http.client
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from conftest import EVERY_ENGINE, engine_fixture

pytest.importorskip("ts")


pytestmark = pytest.mark.serving
engine = engine_fixture(EVERY_ENGINE)

BAD = {
    "lone surrogate": b'{"text": "\\ud800"}',
    "split surrogate pair": b'{"texts": ["good \\ud83d", "\\ude00 movie"]}',
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "NaN text": b'{"text": NaN}',
    "Infinity text": b'{"texts": ["fine", Infinity]}',
    "invalid UTF-8": b'{"text": "\xff\xfe great"}',
    "empty body": b"",
    "number of 5000 digits": b'{"text": ' + b"9" * 5000 + b"}",
}
GOOD = {f"great lovely movie number {i}": "positive" for i in range(4)} | {
    f"awful dull boring film number {i}": "negative" for i in range(4)}


def post(info: dict, body: bytes, timeout: float = 60) -> tuple[int, int, bytes]:
    """(status, X-Batch-Size or 0, body) of one POST of raw bytes as JSON, with the
    server's token."""
    url = urlsplit(info["url"])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if info.get("token"):
        headers["Authorization"] = f"Bearer {info['token']}"
    try:
        connection.request("POST", url.path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, int(answer.headers.get("X-Batch-Size") or 0), answer.read()
    finally:
        connection.close()


def post_together(info: dict, bodies: list[bytes]) -> list[tuple[int, int, bytes]]:
    """Every body POSTed at once (threads released by one barrier)."""
    gate = threading.Barrier(len(bodies))

    def ask(body: bytes) -> tuple[int, int, bytes]:
        gate.wait()
        return post(info, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(ask, bodies))


def test_sixteen_requests_one_of_each_bad_kind(served: dict) -> None:
    goods = {text: json.dumps({"text": text}).encode() for text in GOOD}
    alone = {}
    for text, body in goods.items():
        status, _, answer = post(served, body)
        assert status == 200, (text, status, answer)
        alone[text] = json.loads(answer)
        assert alone[text]["label"] == GOOD[text]
    rng = random.Random(39)
    bodies = [(None, kind, body) for kind, body in BAD.items()] + [
        (text, None, body) for text, body in goods.items()]
    assert len(bodies) == 16
    shared = 0  # bad answers that came from a batch of more than one request
    for _ in range(3):
        rng.shuffle(bodies)
        answers = post_together(served, [body for *_, body in bodies])
        for (text, kind, _), (status, batch, answer) in zip(bodies, answers, strict=True):
            if kind is not None:
                assert 400 <= status < 500, (kind, status, answer[:300])
                shared += batch > 1
                continue
            assert status == 200, (text, status, answer[:300])
            got = json.loads(answer)
            assert got["label"] == GOOD[text]
            assert max(abs(got["probabilities"][n] - p)
                       for n, p in alone[text]["probabilities"].items()) <= 1e-5
    assert shared > 0  # else this test would say nothing about batches
