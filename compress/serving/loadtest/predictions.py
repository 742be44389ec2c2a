"""A bounded HTTP load test of a TorchServe prediction endpoint on this machine (a
classifier's or an embedding model's JSON bodies, or a reranker's query and documents).

Standard library only: a pool of threads, each holding its own persistent
``http.client.HTTPConnection``, keeps exactly ``concurrency`` POSTs in flight until ``requests``
have been sent. Only loopback URLs (127.0.0.1, localhost, ::1) are accepted
(`arguments.check_loopback`), so the tool cannot be pointed at someone else's server.

Latency percentiles are nearest-rank (`workers.percentile`): always a latency that
was observed.

Batch sizes come from the ``X-Batch-Size`` response header, when the handler sets one.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from compress.errors import UserError
from compress.serving.loadtest.arguments import MAX_CONCURRENCY, check_int, check_load_args
from compress.serving.loadtest.report import concurrency_ratio, fixed_width
from compress.serving.loadtest.workers import (
    MAX_ERROR_EXAMPLES,
    HttpWorker,
    Tickets,
    batch_stats,
    percentile,
    run_workers,
)

SAMPLE_TEXTS = (
    "a gripping, beautiful film",
    "the plot is thin and the jokes fall flat",
    "an unexpectedly moving story told with real warmth and wit",
    "two hours of my life i will never get back",
    "the performances are strong, but the script meanders through a long and "
    "uneven second act before a satisfying finale",
    "dull",
)


def load_payloads(texts_file: str | None) -> list[bytes]:
    """JSON request bodies: one per non-empty line of `texts_file`, or SAMPLE_TEXTS."""
    return [json.dumps({"text": t}).encode() for t in read_texts(texts_file)]


RERANK_DOCUMENTS = 8  # documents a reranker's load-test request sends with its query


def read_texts(texts_file: str | None) -> tuple[str, ...]:
    """The non-empty lines of `texts_file`, or SAMPLE_TEXTS."""
    if not texts_file:
        return SAMPLE_TEXTS
    texts = tuple(line.strip() for line in Path(texts_file).read_text().splitlines()
                  if line.strip())
    if not texts:
        raise UserError(f"{texts_file}: no text lines to send")
    return texts


def rerank_payloads(texts_file: str | None, documents: int = RERANK_DOCUMENTS) -> list[bytes]:
    """A reranker's request bodies (its native route's, which `v1/rerank` also takes): one
    per text line, that line as the query and the `documents` lines after it (cycling) as
    the documents."""
    texts = read_texts(texts_file)
    return [json.dumps({"query": query, "documents": [
        texts[(i + 1 + k) % len(texts)] for k in range(documents)]}).encode()
        for i, query in enumerate(texts)]


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
        check_int("concurrency", c, 1, MAX_CONCURRENCY)
    check_load_args(url, concurrencies[0], requests, payloads, warmup, timeout)
    runs = [run_load(url, c, requests, payloads, headers=headers, timeout=timeout,
                     warmup=warmup) for c in concurrencies]
    return {"url": url, "runs": runs, "throughput_ratio": concurrency_ratio(runs)}


def format_table(result: dict) -> str:
    """A fixed-width text table of a ``sweep`` result (or of one ``run_load`` result)."""
    runs = result.get("runs", [result])
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("ok", "ok"),
               ("errors", "errors"), ("rps", "throughput_rps"), ("p50 ms", "latency_ms_p50"),
               ("p90 ms", "latency_ms_p90"), ("p99 ms", "latency_ms_p99"),
               ("batch mean", "batch_size_mean"), ("batch max", "batch_size_max")]
    lines = fixed_width(columns, runs)
    if runs:
        high = max(run["concurrency"] for run in runs)
        low = min(run["concurrency"] for run in runs)
        ratio = result.get("throughput_ratio", concurrency_ratio(runs))
        shown = "n/a" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"throughput at concurrency {high} / concurrency {low}: {shown}")
    return "\n".join(lines)
