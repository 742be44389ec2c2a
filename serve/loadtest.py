"""A bounded HTTP load test of a TorchServe prediction endpoint on this machine.

Standard library only: a pool of threads, each holding its own persistent
``http.client.HTTPConnection``, keeps exactly ``concurrency`` POSTs in flight until ``requests``
have been sent. Only loopback URLs (127.0.0.1, localhost, ::1) are accepted, so the tool cannot
be pointed at someone else's server.

Latency percentiles use the nearest-rank method: the p-th percentile of n sorted latencies is
the value at 1-based rank ``ceil(p / 100 * n)``, so it is always a latency that was observed.

Batch sizes come from the ``X-Batch-Size`` response header, when the handler sets one.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

from compress.errors import UserError
from serve.loadtest_report import _ratio

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_CONCURRENCY = 256
MAX_REQUESTS = 100_000
MAX_ERROR_EXAMPLES = 3
BATCH_HEADER = "X-Batch-Size"

# Failures that mean "the server closed an idle keep-alive connection": on a reused connection
# the request is sent once more on a fresh one before it counts as an error.
_STALE_CONNECTION_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError,
                            BrokenPipeError, ConnectionAbortedError)


def check_loopback(url: str) -> None:
    """Raise UserError unless ``url`` is http:// on 127.0.0.1, localhost or ::1."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        _ = parts.port  # raises ValueError on a malformed port
    except ValueError as exc:
        raise UserError(f"load test URL {url!r} is malformed ({exc}): give one like "
                        "http://127.0.0.1:8080/predictions/MODEL") from None
    if parts.scheme != "http":
        raise UserError(f"load test URL {url!r} uses scheme {parts.scheme or 'none'!r}: "
                        "only plain http:// to a local TorchServe is supported, e.g. "
                        "http://127.0.0.1:8080/predictions/MODEL")
    if host not in LOOPBACK_HOSTS:
        raise UserError(f"load test URL {url!r} points at host {host or 'none'!r}: only "
                        "loopback hosts (127.0.0.1, localhost, ::1) are allowed; run the load "
                        "test on the machine that serves the model")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{name} must be an integer from {low} to {high}, got {value!r}: "
                        "pick a value in that range")


def _check_args(url: str, concurrency: int, requests: int, payloads: list[bytes],
                warmup: int, timeout: float) -> None:
    check_loopback(url)
    _check_int("concurrency", concurrency, 1, MAX_CONCURRENCY)
    _check_int("requests", requests, 1, MAX_REQUESTS)
    _check_int("warmup", warmup, 0, MAX_REQUESTS)
    if not payloads or not all(isinstance(p, bytes | bytearray) for p in payloads):
        raise UserError("payloads must be a non-empty list of bytes: give at least one "
                        "request body, e.g. [b'{\"text\": \"hello\"}']")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values, rounded to 0.01; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return round(sorted_values[rank - 1], 2)


class _Worker:
    """One thread's connection and its tallies."""

    def __init__(self, host: str, port: int | None, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None
        self.used = False  # whether self.conn has already carried a request
        self.latencies_ms: list[float] = []
        self.batch_headers: list[str] = []
        self.errors = 0
        self.error_examples: list[str] = []
        self.error_kinds: Counter[str] = Counter()  # "HTTP 401" or an exception's type

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self.used = False
        return self.conn

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def connect(self) -> None:
        """Open the connection ahead of time; a failure here is retried by the first request."""
        try:
            self._connection().connect()
        except OSError:
            self._drop()

    def close(self) -> None:
        self._drop()

    def _post(self, path: str, body: bytes, headers: dict[str, str]
              ) -> tuple[int, bytes, str | None]:
        """Send one POST, once more on a fresh connection if a reused one turned out stale."""
        for attempt in (0, 1):
            conn = self._connection()
            reused = self.used
            try:
                conn.request("POST", path, body=body, headers=headers)
                self.used = True
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, data, resp.getheader(BATCH_HEADER)
            except _STALE_CONNECTION_ERRORS:
                self._drop()
                if attempt or not reused:
                    raise
            except BaseException:
                self._drop()
                raise
        raise AssertionError("unreachable")

    def send(self, path: str, body: bytes, headers: dict[str, str], record: bool) -> None:
        """Send one request; when ``record``, count it and keep its latency."""
        start = time.perf_counter()
        try:
            status, data, batch = self._post(path, body, headers)
        except Exception as exc:  # any failure is one counted error
            if record:
                self._error(type(exc).__name__, f"{type(exc).__name__}: {exc}")
            return
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if not record:
            return
        if 200 <= status < 300:
            self.latencies_ms.append(elapsed_ms)
            if batch is not None:
                self.batch_headers.append(batch.strip())
        else:
            text = data[:200].decode("utf-8", errors="replace")
            self._error(f"HTTP {status}", f"HTTP {status}: {text}")

    def _error(self, kind: str, text: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1
        if len(self.error_examples) < MAX_ERROR_EXAMPLES:
            self.error_examples.append(" ".join(text.split())[:240])


class _Counter:
    """A thread-safe ticket dispenser: next() gives 0, 1, ... up to limit - 1, then None."""

    def __init__(self, limit: int):
        self.limit, self.value, self.lock = limit, 0, threading.Lock()

    def next(self) -> int | None:
        with self.lock:
            if self.value >= self.limit:
                return None
            self.value += 1
            return self.value - 1


def _batch_stats(values: list[str]) -> tuple[dict[str, int], float | None, int | None]:
    def order(key: str) -> tuple[int, float, str]:
        try:
            return (0, float(key), key)
        except ValueError:
            return (1, 0.0, key)

    counts = dict(sorted(Counter(values).items(), key=lambda item: order(item[0])))
    numbers: list[int] = []
    for value in values:
        with contextlib.suppress(ValueError):
            numbers.append(int(value))
    if not numbers:
        return counts, None, None
    return counts, round(sum(numbers) / len(numbers), 2), max(numbers)


def run_workers(workers: list, work, start_line: threading.Barrier) -> float:
    """Run `work(worker)` on one thread per worker, released together at `start_line`;
    the seconds from the release until the last thread ends."""
    threads = [threading.Thread(target=work, args=(w,), name=f"loadtest-{k}", daemon=True)
               for k, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def run_load(url: str, concurrency: int, requests: int, payloads: list[bytes],
             headers: dict[str, str] | None = None, timeout: float = 60.0,
             warmup: int = 0) -> dict:
    """POST ``requests`` bodies to ``url`` with ``concurrency`` in flight; return the numbers.

    Bodies cycle through ``payloads`` (request i sends ``payloads[i % len(payloads)]``).
    ``warmup`` requests go first over the same connections and are not counted. Content-Type
    is application/json unless ``headers`` sets it. Latency percentiles are nearest-rank over
    the successful (2xx) requests, in milliseconds.
    """
    _check_args(url, concurrency, requests, payloads, warmup, timeout)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    send_headers = {"Content-Type": "application/json"}
    if headers:
        if any(k.lower() == "content-type" for k in headers):
            send_headers = {}
        send_headers.update(headers)
    bodies = [bytes(p) for p in payloads]

    n_threads = min(concurrency, requests)
    workers = [_Worker(parts.hostname or "", parts.port, timeout) for _ in range(n_threads)]
    warm_tickets, tickets = _Counter(warmup), _Counter(requests)
    start_line = threading.Barrier(n_threads + 1)

    def work(worker: _Worker) -> None:
        try:
            worker.connect()
            while (i := warm_tickets.next()) is not None:
                worker.send(path, bodies[i % len(bodies)], send_headers, record=False)
        finally:
            start_line.wait()  # everyone starts the measured phase together
        try:
            while (i := tickets.next()) is not None:
                worker.send(path, bodies[i % len(bodies)], send_headers, record=True)
        finally:
            worker.close()

    wall_s = run_workers(workers, work, start_line)

    latencies = sorted(ms for w in workers for ms in w.latencies_ms)
    examples = [e for w in workers for e in w.error_examples][:MAX_ERROR_EXAMPLES]
    batch_sizes, batch_mean, batch_max = _batch_stats([b for w in workers
                                                       for b in w.batch_headers])
    ok = len(latencies)
    kinds: Counter[str] = sum((w.error_kinds for w in workers), Counter())
    return {
        "concurrency": concurrency, "requests": requests, "ok": ok,
        "errors": sum(w.errors for w in workers), "error_examples": examples,
        "error_kinds": dict(kinds.most_common()),  # "HTTP 401" or an exception type -> count
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(ok / wall_s, 2) if wall_s > 0 else 0.0,
        "latency_ms_p50": _percentile(latencies, 50),
        "latency_ms_p90": _percentile(latencies, 90),
        "latency_ms_p99": _percentile(latencies, 99),
        "batch_sizes": batch_sizes, "batch_size_mean": batch_mean, "batch_size_max": batch_max,
    }


def sweep(url: str, concurrencies: list[int], requests: int, payloads: list[bytes],
          headers: dict[str, str] | None = None, warmup: int = 0,
          timeout: float = 60.0) -> dict:
    """Run ``run_load`` at each concurrency in order; compare largest to smallest throughput."""
    if not concurrencies:
        raise UserError("concurrencies is empty: give at least one, e.g. [1, 4, 16]")
    for c in concurrencies:
        _check_int("concurrency", c, 1, MAX_CONCURRENCY)
    _check_args(url, concurrencies[0], requests, payloads, warmup, timeout)
    runs = [run_load(url, c, requests, payloads, headers=headers, timeout=timeout,
                     warmup=warmup) for c in concurrencies]
    return {"url": url, "runs": runs, "throughput_ratio": _ratio(runs)}


def failure_summary(result: dict, credentials: bool) -> str | None:
    """`N of M requests failed (first: ...)` for a sweep or run_load result (None when all
    succeeded), with a hint when every request got HTTP 401 and no --token/--run was given."""
    runs = result.get("runs", [result])
    failed, sent = sum(r.get("errors", 0) for r in runs), sum(r.get("requests", 0) for r in runs)
    if not failed:
        return None
    first = next((e for r in runs for e in r.get("error_examples", [])), "no example kept")
    line = f"{failed} of {sent} requests failed (first: {first[:100].rstrip()}" + (
        "...)" if len(first) > 100 else ")")
    if not credentials and sum(r.get("error_kinds", {}).get("HTTP 401", 0) for r in runs) == sent:
        line += ("; the server has token authorization on: pass --token TOKEN or --run RUN_DIR "
                 "(the run folder it serves)")
    return line


from serve.loadtest_report import (  # noqa: E402,F401 (the load test's API)
    SAMPLE_TEXTS,
    format_table,
    load_payloads,
    record_result,
)
