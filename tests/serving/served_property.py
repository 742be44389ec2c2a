"""What the three served families' property tests share (issue 70): a probe that times a
plain request all through a property run, requests released together behind a barrier,
and the tally of a run (generated cases apart from the `@example`s, how each was shown to
share a batch with good requests).

A case's round is sent again (at most ROUNDS times) until the server's own batch evidence
(`X-Batch-Size`) shows that the generated request shared a batch with good ones; a case
that never did fails the test."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

TIMEOUT_S = 60.0  # an answer later than this is a hang
# a plain request's answer, throughout a property run: seconds, where a request held
# behind an odd one (a parse, a compile) waited for it; not a latency figure (a CI run on
# a loaded 2-core machine saw 1.19 s)
PLAIN_LIMIT_S = 3.0
JSON, FORM = "application/json", "application/x-www-form-urlencoded"
ROUNDS = 5  # a case sent again until its request shared a batch with good ones (a CI run
# on a loaded 2-core machine: 654 cases shared at once, 31 at the 2nd, 4 at the 3rd, 1 never in 3)


def examples(default: int) -> int:
    """The generated cases a property test runs: COMPRESS_PROPERTY_EXAMPLES, else `default`."""
    return int(os.environ.get("COMPRESS_PROPERTY_EXAMPLES", str(default)))


@dataclass
class Answer:
    """One HTTP answer: status, headers (names lower-cased), body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def batch(self) -> int:
        """The server's `X-Batch-Size` (0 where the answer has none)."""
        return int(self.headers.get("x-batch-size") or 0)


def post(info: dict, path: str, body: bytes, content_type: str = "application/json",
         timeout: float = TIMEOUT_S) -> Answer:
    """One POST to the served model's URL + `path`, with the server's token; a socket
    timeout (a hang) raises."""
    url = urlsplit(info["url"])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    headers = {"Content-Type": content_type}
    if info.get("token"):
        headers["Authorization"] = f"Bearer {info['token']}"
    try:
        connection.request("POST", url.path + path, body=body, headers=headers)
        answer = connection.getresponse()
        return Answer(answer.status, {k.lower(): v for k, v in answer.getheaders()},
                      answer.read())
    finally:
        connection.close()


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call's result, all started at one moment (threads behind one barrier)."""
    gate = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        gate.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


class Probe:
    """A thread that sends `plain()` (a small good request) every `every_s` seconds while
    a property runs and keeps each answer's time; `worst()` is the slowest, and every
    answer must have been a 200."""

    def __init__(self, plain: Callable[[], Answer], every_s: float = 0.25):
        self.plain, self.every_s = plain, every_s
        self.times: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plain-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                answer = self.plain()
                if answer.status != 200:
                    self.failures.append(f"HTTP {answer.status}: {answer.body[:200]!r}")
            except OSError as exc:
                self.failures.append(repr(exc))
            self.times.append(time.perf_counter() - began)
            self._stop.wait(self.every_s)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S + 5)

    def worst(self) -> float:
        return max(self.times, default=0.0)


@dataclass
class Tally:
    """What a property run sent: cases by origin, statuses, rounds needed to share a
    batch, and what each valid case was compared with."""

    generated: int = 0  # cases whose body the strategies drew (not an @example)
    named: int = 0  # @example cases
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)  # "odd", "arbitrary valid", ...
    rounds: Counter = field(default_factory=Counter)  # rounds a case took to share a batch
    compared: int = 0  # valid cases whose answer was compared with the one it gets alone

    def count(self, generated: bool, kind: str, status: int) -> None:
        if generated:
            self.generated += 1
        else:
            self.named += 1
        self.kinds[kind] += 1
        self.statuses[status] += 1

    def line(self, family: str, engine: str, probe: Probe) -> str:
        return (f"property cases ({family}, {engine}): {self.generated} generated + "
                f"{self.named} named; kinds {dict(self.kinds)}; statuses "
                f"{dict(sorted(self.statuses.items()))}; compared with alone {self.compared}; "
                f"rounds to share a batch {dict(sorted(self.rounds.items()))}; plain probe "
                f"{len(probe.times)} requests, slowest {probe.worst():.3f} s")


def until_shared(round_once: Callable[[], tuple[Any, bool]], tally: Tally) -> Any:
    """`round_once()` -> (its result, whether the generated request shared a batch with
    good ones), run again until it did (at most ROUNDS); the last result."""
    for attempt in range(1, ROUNDS + 1):
        result, shared = round_once()
        if shared:
            tally.rounds[attempt] += 1
            return result
    raise AssertionError(f"the generated request shared no batch with good ones in {ROUNDS} "
                         "rounds (X-Batch-Size)")


def frontend_form_refusal(engine: str, content_type: str, answer: Answer) -> bool:
    """Whether `answer` is TorchServe's frontend refusing a form body it cannot decode (a
    500 that no handler code produces; see test_classifier_property's docstring)."""
    if engine != "torchserve" or content_type != FORM or answer.status != 500:
        return False
    try:
        return json.loads(answer.body).get("type") == "ErrorDataDecoderException"
    except ValueError:
        return False


def beside_goods(goods: list[Callable[[], Answer]], mine: Callable[[], Answer], place: int,
                 tally: Tally, refused: Callable[[Answer], bool]) -> tuple[Answer, list[Answer]]:
    """`mine()` sent at one moment with the `goods` calls, at `place` among them, again until
    its answer shows it shared a batch with them (or `refused(answer)`: no batch was ever
    formed for it); (its answer, theirs)."""
    def round_once() -> tuple[tuple[Answer, list[Answer]], bool]:
        calls = list(goods)
        calls.insert(place, mine)
        answers = together(calls)
        answer = answers.pop(place)
        return (answer, answers), refused(answer) or answer.batch > 1

    return until_shared(round_once, tally)


def check_run(tally: Tally, probe: Probe, wanted: int) -> None:
    """The run's own claims: enough generated cases (apart from the @examples), every plain
    probe answered 200 within PLAIN_LIMIT_S."""
    assert tally.generated >= wanted, (tally.generated, wanted)
    assert not probe.failures, probe.failures[:5]
    assert probe.times, "the plain probe sent nothing"
    assert probe.worst() <= PLAIN_LIMIT_S, sorted(probe.times)[-5:]


def run_property(check: Callable[[], None], tally: Tally, probe: Probe, family: str,
                 engine: str, wanted: int) -> None:
    """Run the hypothesis `check` with the plain probe going, print its tally however it
    ends, then hold the run to its claims: `check_run`, and both strategies ran with at
    least one answer compared with its alone answer."""
    try:
        with probe:
            check()
    finally:
        print(tally.line(family, engine, probe))
    check_run(tally, probe, wanted)
    assert tally.kinds["odd"] and tally.compared  # both strategies ran


def text_items_valid(value: Any, max_chars: int, max_items: int) -> bool:
    """The text handlers' contract (classifier, embedding's native route) for a body's
    value: `{"texts": [1..max_items texts]}`, `{"text": text}` or a text; a text is a
    non-blank string of at most `max_chars` characters of valid Unicode (no lone
    surrogate)."""
    many = isinstance(value, dict) and "texts" in value
    texts = value
    if isinstance(value, dict):
        texts = value.get("texts") if many else value.get("text")
    texts = texts if many else [texts]
    return (isinstance(texts, list) and 0 < len(texts) <= max_items
            and all(isinstance(t, str) and t.strip() and len(t) <= max_chars
                    and not any(0xD800 <= ord(c) <= 0xDFFF for c in t) for t in texts))


def json_value(body: bytes, content_type: str) -> tuple[bool, Any]:
    """(whether it reads, the value) of a body as a text handler reads it: UTF-8; parsed
    as JSON where the type says JSON or the text looks like JSON (`{`, `[`), else the text;
    a form's field `text` as `{"text": ...}`."""
    if content_type == FORM:
        fields = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        if "body" in fields or "data" in fields or "text" not in fields:
            return False, None
        return True, {"text": fields["text"]}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return False, None
    if content_type != JSON and text.lstrip()[:1] not in ("{", "["):
        return True, text
    if not text.strip():
        return False, None
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def text_body_valid(body: bytes, content_type: str, max_chars: int, max_items: int) -> bool:
    """Whether a text handler's native route must answer this body with 200 (else 4xx)."""
    reads, value = json_value(body, content_type)
    return reads and text_items_valid(value, max_chars, max_items)
