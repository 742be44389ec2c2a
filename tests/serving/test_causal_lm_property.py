"""A property of the served causal LM, on TorchServe and LitServe (the `engine` fixture):
any request body (any bytes, any JSON value at any nesting, any Unicode with lone
surrogates, NaN, huge numbers, empty strings; on the native and the OpenAI routes), sent
together with good greedy requests, gets a 2xx or a 4xx and never hangs, and each good
request gets exactly the answer it gets alone (its streamed deltas adding up to it).

COMPRESS_PROPERTY_EXAMPLES sets how many generated bodies run (default 20, beside the named
examples); benchmarks/soak/run.py runs many. The number that ran is printed."""

from __future__ import annotations

import http.client
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

pytest.importorskip("ts")
hypothesis = pytest.importorskip("hypothesis")

import test_causal_lm_serving  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_causal_lm_serving import PROMPTS, offline_text  # noqa: E402

# the causal-LM serving tests' archive, server (per engine) and offline model
causal_lm_run = test_causal_lm_serving.causal_lm_run
served, offline = test_causal_lm_serving.served, test_causal_lm_serving.offline

pytestmark = pytest.mark.serving

EXAMPLES = int(os.environ.get("COMPRESS_PROPERTY_EXAMPLES", "20"))
ROUTES = ("", "/1.0/v1/chat/completions", "/1.0/v1/completions")
GOOD = [{"prompt": PROMPTS[0], "max_new_tokens": 8, "stream": False},
        {"prompt": PROMPTS[1], "max_new_tokens": 8},
        {"prompt": PROMPTS[2], "max_new_tokens": 8}]
RAN: list[int] = []

texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates too
numbers = (st.integers(-10**30, 10**30) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 1, 160, 161, 2**63, 2**64, 1e308, -0.0]))
json_values = st.recursive(st.none() | st.booleans() | numbers | texts,
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=20)
requests = st.fixed_dictionaries(
    {}, optional={"prompt": json_values | texts, "messages": json_values,
                  "max_new_tokens": json_values, "max_tokens": json_values,
                  "temperature": json_values, "top_p": json_values, "stop": json_values,
                  "seed": json_values, "stream": json_values, "model": json_values})


def encoded(value, ascii_only: bool) -> bytes:
    """JSON text of `value` (NaN as JSON's non-standard NaN; lone surrogates escaped, or
    written raw as the invalid UTF-8 they make)."""
    return json.dumps(value, allow_nan=True, ensure_ascii=ascii_only).encode(
        "utf-8", "surrogatepass")


bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(encoded, json_values | requests, st.booleans()),
    st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 100_000).map(lambda n: b'{"prompt": ' * n + b'"x"' + b"}" * n))


def post(info: dict, path: str, body: bytes) -> tuple[int, bytes]:
    """(status, whole answer) of one POST; a hang past 60 s raises."""
    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path + path, body=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {info['token']}"})
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, data


def good_answer(status: int, data: bytes) -> tuple[int, str]:
    """(status, text) of a good native answer, checking that a stream's deltas add up."""
    lines = [json.loads(line) for line in data.splitlines()]
    if len(lines) > 1:
        assert "".join(line["delta"] for line in lines[:-1]) == lines[-1]["text"]
    return status, lines[-1]["text"]


@pytest.fixture(scope="module")
def alone(served: dict) -> list[tuple[int, str]]:
    """Each good request's answer when it is sent alone."""
    return [good_answer(*post(served, "", json.dumps(body).encode())) for body in GOOD]


@pytest.fixture(scope="module", autouse=True)
def quote_cases(engine: str):
    RAN.clear()
    yield
    print(f"\nproperty ({engine}): {len(RAN)} generated bodies beside {len(GOOD)} good "
          f"requests each; statuses {sorted(set(RAN))}")


def test_any_body_beside_good_requests_changes_no_answer(served: dict, alone) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, route=st.sampled_from(ROUTES))
    @example(body=json.dumps({"prompt": "\ud800"}).encode(), route="")  # a lone surrogate
    @example(body=b'{"prompt": "\xed\xa0\x80"}', route="")  # a surrogate written as UTF-8
    @example(body=json.dumps({"prompt": "a\ud83d", "stop": "\ude00"}).encode(), route="")
    @example(body=b"[" * 100_000 + b"]" * 100_000, route="")  # nested 100,000 deep
    @example(body=b'{"prompt": "hi", "max_new_tokens": NaN}', route="")
    @example(body=b'{"prompt": "hi", "temperature": Infinity}', route=ROUTES[1])
    @example(body=json.dumps({"prompt": "hi", "max_new_tokens": 10**40}).encode(), route="")
    @example(body=json.dumps({"prompt": "", "stop": [""]}).encode(), route="")
    @example(body=json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}).encode(),
             route=ROUTES[1])
    @example(body=b"", route=ROUTES[2])
    def case(body: bytes, route: str) -> None:
        gate = threading.Barrier(len(GOOD) + 1)

        def send(path: str, data: bytes) -> tuple[int, bytes]:
            gate.wait()
            return post(served, path, data)

        with ThreadPoolExecutor(len(GOOD) + 1) as pool:
            generated = pool.submit(send, route, body)
            good = [pool.submit(send, "", json.dumps(b).encode()) for b in GOOD]
            status, data = generated.result()
            RAN.append(status)
            assert status < 500, (body[:200], route, status, data[:300])
            assert [good_answer(*f.result()) for f in good] == alone
        if status == 200 and route:  # an OpenAI answer is valid JSON (no NaN)
            for line in data.decode().splitlines():
                if line.startswith("data: {"):
                    json.loads(line[len("data: "):], parse_constant=_refuse)
                elif line.startswith("{"):
                    json.loads(line, parse_constant=_refuse)

    case()
    assert len(RAN) >= min(EXAMPLES, 10)


def _refuse(name: str) -> float:
    raise AssertionError(f"{name} in an answer: not JSON")


def test_the_good_answers_are_the_offline_text(alone, offline) -> None:
    """What the property compares against is itself right (batch-1 greedy decoding)."""
    assert alone == [(200, offline_text(offline, b["prompt"], 8)) for b in GOOD]
