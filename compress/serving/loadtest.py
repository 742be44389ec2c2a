"""A bounded HTTP load test of a TorchServe prediction endpoint on this machine.

Standard library only: a pool of threads, each holding its own persistent
``http.client.HTTPConnection``, keeps exactly ``concurrency`` POSTs in flight until ``requests``
have been sent. Only loopback URLs (127.0.0.1, localhost, ::1) are accepted, so the tool cannot
be pointed at someone else's server.

Latency percentiles are nearest-rank (`loadtest_threads.percentile`): always a latency that
was observed.

Batch sizes come from the ``X-Batch-Size`` response header, when the handler sets one.
"""

from __future__ import annotations

import threading
from collections import Counter
from urllib.parse import urlsplit

from compress.errors import UserError
from compress.serving.http_workers import (
    MAX_ERROR_EXAMPLES,
    HttpWorker,
    Tickets,
    batch_stats,
    percentile,
    run_workers,
)
from compress.serving.load_report import concurrency_ratio

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_CONCURRENCY = 256
MAX_REQUESTS = 100_000


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


def check_load_args(url: str, concurrency: int, requests: int, payloads: list[bytes],
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


def run_load(url: str, concurrency: int, requests: int, payloads: list[bytes],
             headers: dict[str, str] | None = None, timeout: float = 60.0,
             warmup: int = 0) -> dict:
    """POST ``requests`` bodies to ``url`` with ``concurrency`` in flight; return the numbers.

    Bodies cycle through ``payloads`` (request i sends ``payloads[i % len(payloads)]``).
    ``warmup`` requests go first over the same connections and are not counted. Content-Type
    is application/json unless ``headers`` sets it. Latency percentiles are nearest-rank over
    the successful (2xx) requests, in milliseconds.
    """
    check_load_args(url, concurrency, requests, payloads, warmup, timeout)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    send_headers = {"Content-Type": "application/json"}
    if headers:
        if any(k.lower() == "content-type" for k in headers):
            send_headers = {}
        send_headers.update(headers)
    bodies = [bytes(p) for p in payloads]

    n_threads = min(concurrency, requests)
    workers = [HttpWorker(parts.hostname or "", parts.port, timeout) for _ in range(n_threads)]
    warm_tickets, tickets = Tickets(warmup), Tickets(requests)
    start_line = threading.Barrier(n_threads + 1)

    def work(worker: HttpWorker) -> None:
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
    batch_sizes, batch_mean, batch_max = batch_stats([b for w in workers
                                                       for b in w.batch_headers])
    ok = len(latencies)
    kinds: Counter[str] = sum((w.error_kinds for w in workers), Counter())
    return {
        "concurrency": concurrency, "requests": requests, "ok": ok,
        "errors": sum(w.errors for w in workers), "error_examples": examples,
        "error_kinds": dict(kinds.most_common()),  # "HTTP 401" or an exception type -> count
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(ok / wall_s, 2) if wall_s > 0 else 0.0,
        "latency_ms_p50": percentile(latencies, 50),
        "latency_ms_p90": percentile(latencies, 90),
        "latency_ms_p99": percentile(latencies, 99),
        "latency_ms_max": round(latencies[-1], 2) if latencies else None,
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
    check_load_args(url, concurrencies[0], requests, payloads, warmup, timeout)
    runs = [run_load(url, c, requests, payloads, headers=headers, timeout=timeout,
                     warmup=warmup) for c in concurrencies]
    return {"url": url, "runs": runs, "throughput_ratio": concurrency_ratio(runs)}


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


from compress.serving.load_report import (  # noqa: E402,F401 (the load test's API)
    SAMPLE_TEXTS,
    format_table,
    load_payloads,
    record_result,
)
