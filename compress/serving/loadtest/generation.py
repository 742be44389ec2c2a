"""A bounded load test of a served causal LM on this machine: generated tokens per second
and time to first token, read from the streamed answers.

Like `compress.serving.loadtest.predictions` (loopback URLs only, ``concurrency`` requests
in flight on persistent connections until ``requests`` were sent, nearest-rank
percentiles), but each answer is read line by line as the server streams it (NDJSON:
`{"delta"}` chunks, then `{"text", "usage", "finish_reason"}`): time to first token is when
the first line arrives, a request's decode rate is its tokens after the first over the time
after the first line, and throughput is every completion token over the wall time.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

from compress.errors import UserError
from compress.serving.loadtest.arguments import check_load_args
from compress.serving.loadtest.report import fixed_width, plain
from compress.serving.loadtest.workers import (
    BATCH_HEADER,
    MAX_ERROR_EXAMPLES,
    batch_stats,
    drive,
    percentile,
)

SAMPLE_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours.",
    "Explain what a compiler does, briefly.",
    "Give me a short tip for learning to cook.",
    "What is 12 times 7?",
)


def load_prompts(prompts_file: str | None, max_new_tokens: int) -> list[bytes]:
    """Streamed request bodies: one per non-empty line of `prompts_file`, or SAMPLE_PROMPTS."""
    prompts = SAMPLE_PROMPTS
    if prompts_file:
        prompts = tuple(line.strip() for line in Path(prompts_file).read_text().splitlines()
                        if line.strip())
        if not prompts:
            raise UserError(f"{prompts_file}: no prompt lines to send")
    return [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens}).encode()
            for p in prompts]


class _Stream:
    """One thread's connection and what its streamed answers showed."""

    def __init__(self, host: str, port: int | None, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None
        self.rows: list[dict[str, float]] = []  # per answer: ttft, latency, tokens, rate
        self.batches: list[str] = []
        self.errors: list[str] = []

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def send(self, path: str, body: bytes, headers: dict[str, str], record: bool) -> None:
        """POST one request and read its answer as it streams."""
        began = time.perf_counter()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self.conn.request("POST", path, body=body, headers=headers)
            answer = self.conn.getresponse()
            lines, first = [], None
            while line := answer.readline():
                first = first or time.perf_counter()
                lines.append(line)
            answer.read()  # marks an answer with a Content-Length done, so the connection
            done = time.perf_counter()  # takes the next request (readline leaves it open)
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {b''.join(lines)[:200].decode()}")
            final = json.loads(lines[-1])
            tokens = int(final["usage"]["completion_tokens"])
        except Exception as exc:  # any failure is one counted error
            if self.conn is not None:
                self.conn.close()
            self.conn = None
            if record:
                self.errors.append(" ".join(f"{type(exc).__name__}: {exc}".split())[:240])
            return
        if record:
            after = done - (first or done)
            self.rows.append({"ttft_ms": 1000 * ((first or done) - began),
                              "latency_ms": 1000 * (done - began), "tokens": tokens,
                              "rate": (tokens - 1) / after if tokens > 1 and after > 0 else 0})
            if answer.getheader(BATCH_HEADER) is not None:
                self.batches.append(answer.getheader(BATCH_HEADER).strip())


def run_generation_load(url: str, concurrency: int, requests: int, payloads: list[bytes],
                        headers: dict[str, str] | None = None, timeout: float = 300.0,
                        warmup: int = 0) -> dict:
    """POST ``requests`` streamed generations with ``concurrency`` in flight; the numbers."""
    check_load_args(url, concurrency, requests, payloads, warmup, timeout)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    send_headers = {"Content-Type": "application/json", **(headers or {})}
    workers = [_Stream(parts.hostname or "", parts.port, timeout)
               for _ in range(min(concurrency, requests))]
    wall = drive(workers, path, payloads, send_headers, warmup, requests)
    rows = [r for w in workers for r in w.rows]
    tokens = sum(int(r["tokens"]) for r in rows)
    sizes, mean, largest = batch_stats([b for w in workers for b in w.batches])
    ttft = sorted(r["ttft_ms"] for r in rows)
    latency = sorted(r["latency_ms"] for r in rows)
    return {"concurrency": concurrency, "requests": requests, "ok": len(rows),
            "errors": requests - len(rows),
            "error_examples": [e for w in workers for e in w.errors][:MAX_ERROR_EXAMPLES],
            "wall_s": round(wall, 3), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "throughput_rps": round(len(rows) / wall, 2) if wall > 0 else 0.0,
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
            "ttft_ms_p99": percentile(ttft, 99),
            "latency_ms_p50": percentile(latency, 50), "latency_ms_p90": percentile(latency, 90),
            "decode_tok_s_per_request": round(statistics.median(r["rate"] for r in rows), 2)
            if rows else None,
            "batch_sizes": sizes, "batch_size_mean": mean, "batch_size_max": largest}


def sweep_generation(url: str, concurrencies: list[int], requests: int,
                     payloads: list[bytes], headers: dict[str, str] | None = None,
                     warmup: int = 0, timeout: float = 300.0) -> dict:
    """`run_generation_load` at each concurrency in order."""
    if not concurrencies:
        raise UserError("concurrencies is empty: give at least one, e.g. [1, 4, 8]")
    runs = [run_generation_load(url, c, requests, payloads, headers, timeout, warmup)
            for c in concurrencies]
    high, low = runs[-1], runs[0]
    ratio = (round(high["tokens_per_s"] / low["tokens_per_s"], 2)
             if low["tokens_per_s"] else None)
    ttft_ratio = (round(high["ttft_ms_p50"] / low["ttft_ms_p50"], 2)
                  if low["ttft_ms_p50"] and high["ttft_ms_p50"] is not None else None)
    return {"url": url, "task": "causal-lm", "runs": runs, "tokens_per_s_ratio": ratio,
            "ttft_p50_ratio": ttft_ratio}


def format_generation_table(result: dict) -> str:
    """A fixed-width table of a `sweep_generation` result."""
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("ok", "ok"),
               ("errors", "errors"), ("tok/s", "tokens_per_s"),
               ("ttft p50 ms", "ttft_ms_p50"), ("ttft p90 ms", "ttft_ms_p90"),
               ("ttft p99 ms", "ttft_ms_p99"), ("p50 ms", "latency_ms_p50"),
               ("tok/s/req", "decode_tok_s_per_request"),
               ("batch mean", "batch_size_mean"), ("batch max", "batch_size_max")]
    lines = fixed_width(columns, result["runs"], plain)
    ratio = result.get("tokens_per_s_ratio")
    lines.append(f"tokens/s at concurrency {result['runs'][-1]['concurrency']} / concurrency "
                 f"{result['runs'][0]['concurrency']}: "
                 + ("n/a" if ratio is None else f"{ratio:.2f}x"))
    ttft = result.get("ttft_p50_ratio")
    if ttft is not None:
        lines.append(f"time to first token p50 at concurrency {result['runs'][-1]['concurrency']}"
                     f" / concurrency {result['runs'][0]['concurrency']}: {ttft:.2f}x")
    return "\n".join(lines)
