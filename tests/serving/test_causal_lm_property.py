"""Issue 70's property of the served causal LM, on TorchServe, LitServe and Ray Serve (the
`engine` fixture), on the grammar-capable archive of test_causal_lm_openai_features (a tiny
random Llama with SmolLM2's tokenizer: continuous batching, 8 rows, 96 new tokens at most).

Three good native requests (40 greedy tokens each, streamed) start first; once each has
streamed its first chunk (it is decoding), the generated request is sent. Two strategies:

- *valid but odd* requests, every optional field within its type, on the native route,
  `v1/chat/completions` and `v1/completions`: any valid Unicode prompt or messages (text
  parts, developer and tool roles), `max_tokens` / `max_completion_tokens`, `temperature`
  (greedy, seeded, unseeded), `top_p`, `stop`, `seed`, `n` (1-3: beside the 3 good rows and
  the probe's, with a row to spare of the 8, so that it never waits for the good ones to
  end), `stream` with `stream_options`, `logprobs` /
  `top_logprobs`, `response_format` (text, json_object, a small json_schema), `tools` with
  every `tool_choice`, `echo`, `ignore_eos`, nulls, ignored fields. Each gets 200; where its
  answer is promised to repeat (greedy, or sampled with a seed: a row's seed is its own,
  so its tokens do not depend on the batch), it equals the answer it gets alone (text,
  tool calls, finish reasons, usage exactly; log-probabilities within 1e-4; a seeded
  sample that changes is counted, not failed, until the server keeps it:
  `SEEDED_ASSERTED`); a json_schema answer that was not cut by max_tokens validates.
- *arbitrary* bodies (any bytes, any JSON value at any nesting, lone surrogates, NaN, huge
  numbers, request-shaped objects holding anything). `expected_valid`, a small oracle of
  the documented request contract, says which happen to be valid: those get 200 (and
  their alone answer where it repeats), all others a 4xx.

The server's batch evidence (`X-Batch-Size`: the rows decoding when the request's first
token came, or when it arrived for a refusal) shows the generated request beside the good
ones' rows; the round is sent again until it does (`served_property`). Every good request
gets exactly its alone text, its deltas adding up to it. A probe thread sends a plain
request (1 new token) every 0.25 s throughout: each answered 200 within 1 s.

COMPRESS_PROPERTY_EXAMPLES sets how many generated cases run (default 20), asserted apart
from the named @examples; benchmarks/soak/run.py runs many. The run prints its tally."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("ts")
hypothesis = pytest.importorskip("hypothesis")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

import test_causal_lm_openai_features  # noqa: E402
from conftest import EVERY_ENGINE, engine_fixture  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from served_property import (  # noqa: E402
    ROUNDS,
    TIMEOUT_S,
    Answer,
    Probe,
    Tally,
    examples,
    post,
    run_property,
)
from test_causal_lm_serving import PROMPTS, offline_text  # noqa: E402

# the grammar-capable archive, its server (per engine) and its offline model
causal_lm_run = test_causal_lm_openai_features.causal_lm_run
served = test_causal_lm_openai_features.served
offline = test_causal_lm_openai_features.offline

pytestmark = pytest.mark.serving
engine = engine_fixture(EVERY_ENGINE)

EXAMPLES = examples(20)
NATIVE, CHAT, COMPLETIONS = "", "/1.0/v1/chat/completions", "/1.0/v1/completions"
ROUTES = (NATIVE, CHAT, COMPLETIONS)
MAX_NEW, DEFAULT_NEW = 96, 64  # the archive's max_new_tokens and what a request gets unasked
GOOD_TOKENS = 40
GOOD = [{"prompt": p, "max_new_tokens": GOOD_TOKENS} for p in PROMPTS[:3]]
# A sampled request with a seed is promised its alone answer beside any others (DESIGN 11;
# tests/unit/test_causal_lm_batcher.py), but served it is not yet: `{"prompt": "0",
# "temperature": 1.0, "seed": 111}` sent alone, then beside three greedy streams, left its
# alone text after about 17 of 64 tokens (LitServe, issue 70's note). Until the server keeps
# it, a changed seeded answer is counted ("seeded changed" in the tally), not failed; greedy
# answers are compared exactly. Set True once the server keeps it.
SEEDED_ASSERTED = False
PLAIN = json.dumps({"prompt": "hi", "max_new_tokens": 1, "stream": False}).encode()

# ---- arbitrary bodies ------------------------------------------------------------------------

texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates too
numbers = (st.integers(-10**30, 10**30) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 1, 96, 97, 2**63, 2**64, 1e308, -0.0]))
json_values = st.recursive(st.none() | st.booleans() | numbers | texts,
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=20)
shaped = st.fixed_dictionaries(
    {}, optional={"prompt": json_values | texts, "messages": json_values,
                  "max_new_tokens": json_values, "max_tokens": json_values,
                  "temperature": json_values, "top_p": json_values, "stop": json_values,
                  "seed": json_values, "stream": json_values, "model": json_values,
                  "n": json_values, "logprobs": json_values})


def encoded(value: Any, ascii_only: bool) -> bytes:
    """JSON text of `value` (NaN as JSON's non-standard NaN; lone surrogates escaped, or
    written raw as the invalid UTF-8 they make)."""
    return json.dumps(value, allow_nan=True, ensure_ascii=ascii_only).encode(
        "utf-8", "surrogatepass")


arbitrary = st.one_of(
    st.binary(max_size=300),
    st.builds(encoded, json_values | shaped, st.booleans()),
    st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 100_000).map(lambda n: b'{"prompt": ' * n + b'"x"' + b"}" * n))

# ---- valid but odd requests ------------------------------------------------------------------

SAFE = st.characters(exclude_categories=["Cs"])  # any valid Unicode
prompt_text = st.one_of(st.text(SAFE, min_size=1, max_size=60),
                        st.sampled_from(["\x00", " \t hi", "😀" * 20, "שלום", "{", "e\u0301"])
                        ).filter(str.strip)
stops = st.one_of(st.none(), st.text(SAFE, min_size=1, max_size=64),
                  st.lists(st.text(SAFE, min_size=1, max_size=64), max_size=8))
seeds = st.integers(0, 2**64 - 1)
greedy = st.just({"temperature": 0})
seeded = st.fixed_dictionaries({"temperature": st.floats(1e-3, 10), "seed": seeds},
                               optional={"top_p": st.floats(0, 1, exclude_min=True)})
unseeded = st.fixed_dictionaries({"temperature": st.floats(1e-3, 10)},
                                 optional={"top_p": st.floats(0, 1, exclude_min=True)})
sampling = st.one_of(greedy, greedy, seeded, unseeded)
new_tokens = st.integers(1, 24)
PROPERTY = st.sampled_from([{"type": "string", "maxLength": 8}, {"type": "boolean"},
                            {"type": "integer", "minimum": 0, "maximum": 99},
                            {"enum": ["red", "green"]}, {"type": "number"}])
schemas = st.dictionaries(st.sampled_from(["a", "name", "é", "x y"]), PROPERTY, min_size=1,
                          max_size=3).map(lambda props: {
                              "type": "object", "properties": props,
                              "required": sorted(props), "additionalProperties": False})


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.text(SAFE, max_size=60)}), min_size=1, max_size=3).filter(
        lambda ms: any(m["content"].strip() for m in ms))
native = st.builds(merged, st.one_of(st.fixed_dictionaries({"prompt": prompt_text}),
                                     st.fixed_dictionaries({"messages": messages})),
                   st.one_of(st.just({}), greedy, seeded),  # unseeded: OpenAI's routes
                   st.fixed_dictionaries({}, optional={
                       "max_new_tokens": new_tokens, "stop": stops, "stream": st.booleans(),
                       "ignore_eos": st.booleans(), "seed": seeds}))
chat_message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": st.text(SAFE, max_size=60) | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(SAFE, max_size=30)}), min_size=1,
        max_size=2)})


def _content(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


tool = st.builds(lambda name, about, schema: {"type": "function", "function": {
    "name": name, "description": about, "parameters": schema}},
    st.sampled_from(["get_weather", "f", "lookup_2"]), st.text(SAFE, max_size=20), schemas)
tools = st.lists(tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"])
using_tools = tools.flatmap(lambda ts: st.fixed_dictionaries({"tools": st.just(ts)}, optional={
    "tool_choice": st.sampled_from(["none", "auto", "required"]
                                   + [{"type": "function", "function": {"name": t["function"][
                                       "name"]}} for t in ts]),
    "parallel_tool_calls": st.booleans()}))
response_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | schemas.map(
    lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s,
                                                      "strict": True}})
logprobs_chat = st.one_of(st.just({}), st.just({"logprobs": False}), st.builds(
    lambda top: {"logprobs": True, "top_logprobs": top}, st.integers(0, 20)))
streaming = st.one_of(st.just({}), st.just({"stream": False}), st.builds(
    lambda usage: {"stream": True, "stream_options": {"include_usage": usage}}, st.booleans()))
shared_openai = st.fixed_dictionaries({}, optional={
    "max_tokens": new_tokens, "stop": stops, "n": st.integers(1, 3), "model": texts.filter(
        lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)),
    "user": st.text(SAFE, max_size=10), "frequency_penalty": st.just(0),
    "presence_penalty": st.none(), "ignore_eos": st.booleans()})
chat = st.builds(merged, st.fixed_dictionaries({"messages": st.lists(
    chat_message, min_size=1, max_size=3).filter(lambda ms: any(
        _content(m).strip() for m in ms))}),
    sampling, shared_openai, streaming, logprobs_chat,
    st.one_of(st.just({}), st.builds(lambda f: {"response_format": f}, response_format),
              using_tools),
    st.one_of(st.just({}), st.builds(lambda n: {"max_completion_tokens": n}, new_tokens)))
completions = st.builds(merged, st.fixed_dictionaries({"prompt": prompt_text | prompt_text.map(
    lambda p: [p])}), sampling, shared_openai, streaming,
    st.one_of(st.just({}), st.builds(lambda k: {"logprobs": k}, st.integers(0, 20)),
              st.sampled_from([{"echo": True}, {"echo": False}, {"suffix": ""},
                               {"suffix": None}])))
odd = st.one_of(st.tuples(native, st.just(NATIVE)), st.tuples(chat, st.just(CHAT)),
                st.tuples(completions, st.just(COMPLETIONS)))
CASES = st.one_of(
    st.builds(lambda case, ascii_only: (encoded(case[0], ascii_only), case[1], "odd"), odd,
              st.booleans()),
    st.builds(lambda body, route: (body, route, "arbitrary"), arbitrary,
              st.sampled_from(ROUTES)))

# ---- the oracle ------------------------------------------------------------------------------

NATIVE_FIELDS = {"prompt", "messages", "max_new_tokens", "temperature", "top_p", "stop", "seed",
                 "ignore_eos", "stream", "n", "logprobs", "json_schema"}


def _text(value: Any) -> bool:
    """A string the tokenizer takes (no lone surrogate)."""
    return isinstance(value, str) and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)


def _integer(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value: Any, low: float, high: float) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and low <= value <= high)


def native_valid(body: dict) -> bool:
    """The native request contract (requests.py): exactly one of a non-blank prompt and
    non-empty messages of string roles and contents (one not blank); max_new_tokens
    1-96, temperature 0 or 0.001-10, top_p (0, 1], stop a string or at most 8 strings of
    1-64 characters (a falsy value: none), seed 0 to 2**64 - 1 or null, stream and
    ignore_eos true or false; no n above 1, logprobs or json_schema on this route."""
    if set(body) - NATIVE_FIELDS or ("prompt" in body) == ("messages" in body):
        return False
    if "prompt" in body:
        if not (_text(body["prompt"]) and body["prompt"].strip()):
            return False
    else:
        listed = body["messages"]
        if not (isinstance(listed, list) and listed and all(
                isinstance(m, dict) and _text(m.get("role")) and _text(m.get("content"))
                for m in listed) and any(m["content"].strip() for m in listed)):
            return False
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    temperature = body.get("temperature", 0)
    return (_integer(body.get("max_new_tokens", DEFAULT_NEW), 1, MAX_NEW)
            and _number(temperature, 0, 10) and not 0 < temperature < 1e-3
            and _number(body.get("top_p", 1), 0, 1) and body.get("top_p", 1) > 0
            and isinstance(stop, list) and len(stop) <= 8
            and all(isinstance(s, str) and 0 < len(s) <= 64 for s in stop)
            and (body.get("seed") is None or _integer(body["seed"], 0, 2**64 - 1))
            and isinstance(body.get("stream", True), bool)
            and isinstance(body.get("ignore_eos", False), bool)
            and body.get("n", 1) == 1 and _integer(body.get("n", 1), 1, 1)
            and "logprobs" not in body and "json_schema" not in body)


def openai_valid(route: str, body: dict) -> bool:
    """The OpenAI routes' contract (openai_request.py) for the fields the arbitrary bodies
    hold: `null` is absent; chat takes messages, completions a prompt (a string or a list
    of one); max_tokens, temperature (default 1), top_p, stop, seed, n (1-8), stream and
    logprobs (chat: true or false; completions: 0-20) as the native request takes them;
    model is ignored; other fields of the arbitrary bodies are unknown here."""
    body = {k: v for k, v in body.items() if v is not None}
    known = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "n",
             "logprobs"} | ({"messages"} if route == CHAT else {"prompt"})
    if set(body) - known:
        return False
    native: dict = {k: body[k] for k in ("temperature", "top_p", "stop", "seed", "stream")
                    if k in body}
    native.setdefault("temperature", 1.0)
    native.setdefault("stream", False)
    if "max_tokens" in body:
        native["max_new_tokens"] = body["max_tokens"]
    if not _integer(body.get("n", 1), 1, 8):
        return False
    logprobs = body.get("logprobs")
    if route == CHAT:
        if logprobs is not None and not isinstance(logprobs, bool):
            return False
        listed = body.get("messages")
        if not (isinstance(listed, list) and listed and all(
                isinstance(m, dict) and m.get("role") in ("system", "developer", "user",
                                                          "assistant", "tool")
                and _text(m.get("content")) and not m.get("tool_calls") for m in listed)):
            return False
        native["messages"] = [{"role": "user", "content": m["content"]} for m in listed]
    else:
        if logprobs is not None and not _integer(logprobs, 0, 20):
            return False
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        native["prompt"] = prompt
    return native_valid(native)


def expected_valid(body: bytes, route: str) -> bool:
    """Whether the server must answer this body on `route` with 200 (else a 4xx)."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    if not isinstance(value, dict):
        return False
    return native_valid(value) if route == NATIVE else openai_valid(route, value)


def greedy(body: dict, route: str) -> bool:
    """Whether a valid request decodes greedily (temperature 0; native's default)."""
    temperature = body.get("temperature")
    return (0 if temperature is None and route == NATIVE else temperature) == 0


def repeats(body: dict, route: str) -> bool:
    """Whether its answer is promised to repeat: greedy, or sampled with a seed."""
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 0 if route == NATIVE else 1
    return temperature == 0 or body.get("seed") is not None


# ---- answers ---------------------------------------------------------------------------------

def _refuse(name: str) -> float:
    raise AssertionError(f"{name} in an answer: not JSON")


def native_summary(data: bytes) -> tuple[Any, list[float]]:
    """(text, finish, usage) of a native answer, its streamed deltas checked to add up."""
    lines = [json.loads(line, parse_constant=_refuse) for line in data.splitlines()]
    last = lines[-1]
    if len(lines) > 1:
        assert "".join(line["delta"] for line in lines[:-1]) == last["text"]
    return (last["text"], last.get("finish_reason"), last.get("usage")), []


def openai_summary(route: str, data: bytes) -> tuple[Any, list[float]]:
    """(per choice: text, tool calls (name, arguments), finish reason, logprob tokens; the
    usage) of an OpenAI answer, whole or streamed, and its log-probabilities in order, choice
    after choice (a stream interleaves its choices' events as their tokens come: that order
    is the batch's, not the answer's)."""
    text = data.decode()
    if text.startswith("data:") or "\ndata:" in text:
        events = [json.loads(line[len("data: "):], parse_constant=_refuse)
                  for line in text.splitlines() if line.startswith("data: {")]
        assert text.rstrip().endswith("data: [DONE]")
    else:
        events = [json.loads(text, parse_constant=_refuse)]
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for position, choice in enumerate(event.get("choices") or []):
            mine = choices.setdefault(choice.get("index", position), {
                "text": "", "calls": [], "finish": None, "tokens": [], "floats": []})
            part = choice.get("delta") or choice.get("message") or {}
            mine["text"] += (part.get("content") if route == CHAT else choice.get("text")) or ""
            for k, call in enumerate(part.get("tool_calls") or []):
                at = call.get("index", k)
                while len(mine["calls"]) <= at:
                    mine["calls"].append(["", ""])
                function = call.get("function") or {}
                mine["calls"][at][0] += function.get("name") or ""
                mine["calls"][at][1] += function.get("arguments") or ""
            mine["finish"] = choice.get("finish_reason") or mine["finish"]
            logprobs = choice.get("logprobs") or {}
            for entry in logprobs.get("content") or []:  # chat
                mine["tokens"].append(entry["token"])
                mine["floats"] += [entry["logprob"]] + [t["logprob"]
                                                        for t in entry["top_logprobs"]]
            mine["tokens"] += logprobs.get("tokens") or []  # completions
            mine["floats"] += [v for v in logprobs.get("token_logprobs") or [] if v is not None]
            for top in logprobs.get("top_logprobs") or []:
                mine["floats"] += sorted((top or {}).values())
    ordered = sorted(choices.items())
    return ([(k, c["text"], c["calls"], c["finish"], c["tokens"]) for k, c in ordered],
            usage), [v for _, c in ordered for v in c["floats"]]


def summary(route: str, data: bytes) -> tuple[Any, list[float]]:
    return native_summary(data) if route == NATIVE else openai_summary(route, data)


def same(got: tuple[Any, list[float]], want: tuple[Any, list[float]]) -> bool:
    return got[0] == want[0] and len(got[1]) == len(want[1]) and all(
        abs(g - w) <= 1e-4 for g, w in zip(got[1], want[1], strict=True))


def schema_of(body: dict) -> dict | None:
    """The JSON schema a chat answer must meet (response_format), None for free text."""
    kind = (body.get("response_format") or {}).get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        return body["response_format"]["json_schema"]["schema"]
    return None


# ---- the rounds ------------------------------------------------------------------------------

def streamed_good(info: dict, body: dict, decoding: threading.Event) -> Answer:
    """A good native request, streamed: `decoding` is set once its first chunk came."""
    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", parts.path, body=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {info['token']}"})
        answer = conn.getresponse()
        lines = [answer.readline()]
        decoding.set()
        while line := answer.readline():
            lines.append(line)
        return Answer(answer.status, {k.lower(): v for k, v in answer.getheaders()},
                      b"".join(lines))
    finally:
        decoding.set()
        conn.close()


def beside_good(info: dict, route: str, body: bytes) -> tuple[Answer, list[Answer]]:
    """The generated request sent once the good ones are decoding; (its answer, theirs)."""
    started = [threading.Event() for _ in GOOD]
    with ThreadPoolExecutor(len(GOOD)) as pool:
        goods = [pool.submit(streamed_good, info, good, event)
                 for good, event in zip(GOOD, started, strict=True)]
        for event in started:
            event.wait(TIMEOUT_S)
        mine = post(info, route, body)
        return mine, [g.result() for g in goods]


@pytest.fixture(scope="module")
def alone(served: dict) -> list[Any]:
    """Each good request's answer when it is sent alone."""
    answers = [post(served, NATIVE, json.dumps(body).encode()) for body in GOOD]
    assert [a.status for a in answers] == [200] * len(GOOD)
    return [native_summary(a.body) for a in answers]


def too_long(answer: Any) -> bool:
    """A 400 for a prompt that, with its new tokens, does not fit the archive's context: an
    odd request's messages, tools and schemas may be drawn longer than its 512 positions
    (many characters take several tokens each: found by the property, 2026-12-01)."""
    return answer.status == 400 and b"exceed the context" in answer.body


def test_odd_valid_requests_answer_as_alone_and_any_body_fails_alone(
        served: dict, alone, engine: str) -> None:
    tally = Tally()
    plain = Probe(lambda: post(served, NATIVE, PLAIN))

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=CASES, generated=st.just(True))
    @example(case=(json.dumps({"prompt": "\ud800"}).encode(), NATIVE, "arbitrary"),
             generated=False)  # a lone surrogate
    @example(case=(b'{"prompt": "\xed\xa0\x80"}', NATIVE, "arbitrary"), generated=False)
    @example(case=(b"[" * 100_000 + b"]" * 100_000, NATIVE, "arbitrary"), generated=False)
    @example(case=(b'{"prompt": "hi", "max_new_tokens": NaN}', NATIVE, "arbitrary"),
             generated=False)
    @example(case=(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": '
                   b"Infinity}", CHAT, "arbitrary"), generated=False)
    @example(case=(json.dumps({"prompt": "", "stop": [""]}).encode(), NATIVE, "arbitrary"),
             generated=False)
    @example(case=(b"{}", CHAT, "arbitrary"), generated=False)
    @example(case=(b"", COMPLETIONS, "arbitrary"), generated=False)
    @example(case=(json.dumps({"messages": [{"role": "user", "content": "Weather?"}],
                               "tools": [{"type": "function", "function": {
                                   "name": "f", "parameters": {"type": "object"}}}],
                               "tool_choice": "required", "temperature": 0, "n": 2,
                               "max_tokens": 16}).encode(), CHAT, "odd"), generated=False)
    @example(case=(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "json_object"}, "seed": 3,
                               "temperature": 0.7, "logprobs": True, "top_logprobs": 2,
                               "stream": True, "max_tokens": 12}).encode(), CHAT, "odd"),
             generated=False)
    # the soak's 1000 cases on LitServe: this one never showed a good row beside its own
    @example(case=(json.dumps({"prompt": ["\u05e9\u05dc\u05d5\u05dd"], "temperature": 0,
                               "n": 3, "stop": ["\u0004\u00e3~\u00ad.\U000db6d4z"],
                               "max_tokens": 1, "ignore_eos": False, "user": "",
                               "frequency_penalty": 0}).encode(), COMPLETIONS, "odd"),
             generated=False)
    def check(case: tuple[bytes, str, str], generated: bool) -> None:
        body, route, kind = case
        valid = kind == "odd" or expected_valid(body, route)  # odd: valid as it is drawn
        value = json.loads(body) if valid else {}
        want = None
        if valid and repeats(value, route):  # its answer alone
            first = post(served, route, body)
            if kind == "odd" and too_long(first):
                valid = False  # drawn longer than the archive's context: refused, as a bad body
            else:
                assert first.status == 200, (route, body[:300], first.status, first.body[:300])
                want = summary(route, first.body)
        n = (value.get("n") or 1) if valid else 0
        for attempt in range(1, ROUNDS + 1):
            mine, goods = beside_good(served, route, body)
            if mine.batch > n:  # rows beside its own were decoding (or, refused, at arrival)
                tally.rounds[attempt] += 1
                break
        else:
            raise AssertionError(f"no good row beside it in {ROUNDS} rounds: {body[:200]!r}")
        if valid and kind == "odd" and too_long(mine):
            valid = False
        verdict = "valid" if valid else "invalid"
        tally.count(generated, kind if kind == "odd" else f"arbitrary {verdict}", mine.status)
        if valid:
            assert mine.status == 200, (route, body[:300], mine.status, mine.body[:300])
            got = summary(route, mine.body)  # strict JSON, deltas adding up
            if want is not None and not same(got, want):
                assert not SEEDED_ASSERTED and not greedy(value, route), (
                    route, body[:300], got, want)
                tally.kinds["seeded changed"] += 1
            elif want is not None:
                tally.compared += 1
            schema = schema_of(value)  # met where the answer ended by itself: not cut at
            # its token bound ("length") nor at a stop string (its finish is "stop" too)
            for _, text, _, finish, _ in got[0][0] if schema is not None else []:
                if finish != "length" and not value.get("stop"):
                    jsonschema_rs.validate(schema, json.loads(text, parse_float=Decimal))
        else:
            assert 400 <= mine.status < 500, (route, body[:300], mine.status, mine.body[:300])
        for answer, expected in zip(goods, alone, strict=True):
            assert answer.status == 200, (body[:200], answer.status, answer.body[:300])
            assert native_summary(answer.body) == expected, (route, body[:300])

    run_property(check, tally, plain, "causal LM", engine, EXAMPLES)


def test_the_good_answers_are_the_offline_text(alone, offline) -> None:
    """What the property compares against is itself right (batch-1 greedy decoding), and
    long enough to be decoding beside each generated request."""
    assert [a[0][0] for a in alone] == [offline_text(offline, b["prompt"], GOOD_TOKENS)
                                        for b in GOOD]
    assert all(a[0][2]["completion_tokens"] == GOOD_TOKENS for a in alone)
