"""The threads of a load test: each holds its own persistent ``http.client.HTTPConnection``
and takes request numbers from a shared `Tickets` dispenser until none are left.

Latency percentiles use the nearest-rank method: the p-th percentile of n sorted latencies is
the value at 1-based rank ``ceil(p / 100 * n)``, so it is always a latency that was observed.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import threading
import time
from collections import Counter

MAX_ERROR_EXAMPLES = 3
BATCH_HEADER = "X-Batch-Size"

# Failures that mean "the server closed an idle keep-alive connection": on a reused connection
# the request is sent once more on a fresh one before it counts as an error.
STALE_CONNECTION_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError,
                           BrokenPipeError, ConnectionAbortedError)


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values, rounded to 0.01; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return round(sorted_values[rank - 1], 2)


class HttpWorker:
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
            except STALE_CONNECTION_ERRORS:
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


class Tickets:
    """A thread-safe ticket dispenser: next() gives 0, 1, ... up to limit - 1, then None."""

    def __init__(self, limit: int):
        self.limit, self.value, self.lock = limit, 0, threading.Lock()

    def next(self) -> int | None:
        with self.lock:
            if self.value >= self.limit:
                return None
            self.value += 1
            return self.value - 1


def batch_stats(values: list[str]) -> tuple[dict[str, int], float | None, int | None]:
    """(count per batch-size header value, mean and max of the numeric ones)."""
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


def drive(workers: list, path: str, payloads: list[bytes], headers: dict[str, str],
          warmup: int, requests: int) -> float:
    """Each worker `send`s requests of `payloads` in turn: `warmup` unrecorded ones among
    them all, then, released together, `requests` recorded ones; the seconds of the
    recorded part. A worker closes its connection when it is done."""
    warm, tickets = Tickets(warmup), Tickets(requests)
    start_line = threading.Barrier(len(workers) + 1)

    def work(worker) -> None:  # noqa: ANN001 (a stream of either load test)
        try:
            while (i := warm.next()) is not None:
                worker.send(path, payloads[i % len(payloads)], headers, record=False)
        finally:
            start_line.wait()
        while (i := tickets.next()) is not None:
            worker.send(path, payloads[(warmup + i) % len(payloads)], headers, record=True)
        worker.close()

    return run_workers(workers, work, start_line)
