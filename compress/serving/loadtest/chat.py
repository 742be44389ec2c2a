"""A bounded load test of an OpenAI `/v1/chat/completions` endpoint on this machine,
streamed: compress's servers (TorchServe or LitServe, at
`/predictions/<model>/v1/chat/completions`) and llama.cpp's `llama-server` (at
`/v1/chat/completions`) are driven by the same client.

Like `compress.serving.loadtest.generation` (loopback URLs only, `concurrency` requests in
flight on persistent connections until `requests` were sent, `warmup` requests first and
not counted, nearest-rank percentiles), but each answer is read as server-sent events
(`compress.serving.loadtest.chat_stream`): time to first token (TTFT) is the first content event,
inter-token latency (ITL) percentiles are over every gap between content events of every
answer, and aggregate tok/s is every completion token over the wall time.
"""

from __future__ import annotations

import statistics
from urllib.parse import urlsplit

from compress.errors import UserError
from compress.serving.loadtest.arguments import check_load_args
from compress.serving.loadtest.chat_stream import ChatStream
from compress.serving.loadtest.report import fixed_width, plain
from compress.serving.loadtest.workers import MAX_ERROR_EXAMPLES, drive, percentile

CHAT_PATH = "/v1/chat/completions"


def is_chat_url(url: str) -> bool:
    """Whether `url` is an OpenAI chat completions endpoint (its path ends in CHAT_PATH)."""
    return urlsplit(url).path.rstrip("/").endswith(CHAT_PATH)


def run_chat_load(url: str, concurrency: int, requests: int, payloads: list[bytes],
                  headers: dict[str, str] | None = None, timeout: float = 300.0,
                  warmup: int = 0) -> dict:
    """POST `requests` streamed chat completions with `concurrency` in flight; the numbers.
    Warm-up request k sends payloads[k % len], measured request i payloads[(warmup + i) %
    len]: with `warmup + requests` payloads no measured request repeats a warm-up one."""
    check_load_args(url, concurrency, requests, payloads, warmup, timeout)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    send_headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                    **(headers or {})}
    workers = [ChatStream(parts.hostname or "", parts.port, timeout)
               for _ in range(min(concurrency, requests))]
    wall = drive(workers, path, payloads, send_headers, warmup, requests)
    return chat_figures([r for w in workers for r in w.rows],
                        [e for w in workers for e in w.errors], concurrency, requests, wall)


def chat_figures(rows: list[dict], errors: list[str], concurrency: int, requests: int,
                 wall: float) -> dict:
    """The figures of one load level from its answers' rows (ChatStream.rows)."""
    tokens = sum(int(r["tokens"]) for r in rows)
    ttft = sorted(r["ttft_ms"] for r in rows)
    gaps = sorted(g for r in rows for g in r["gaps_ms"])
    latency = sorted(r["latency_ms"] for r in rows)
    sources = sorted({r["tokens_from"] for r in rows})
    prompt = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens") is not None]
    return {"concurrency": concurrency, "requests": requests, "ok": len(rows),
            "errors": requests - len(rows), "error_examples": errors[:MAX_ERROR_EXAMPLES],
            "wall_s": round(wall, 3), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "itl_ms_p50": percentile(gaps, 50), "itl_ms_p99": percentile(gaps, 99),
            "latency_ms_p50": percentile(latency, 50),
            "tokens_per_request": round(tokens / len(rows), 2) if rows else None,
            "tokens_from": "+".join(sources) or None,
            "prompt_tokens_mean": round(statistics.fmean(prompt), 1) if prompt else None}


def sweep_chat(url: str, concurrencies: list[int], requests: int, payloads: list[bytes],
               headers: dict[str, str] | None = None, warmup: int = 0,
               timeout: float = 300.0) -> dict:
    """`run_chat_load` at each concurrency in order, with the highest over the lowest."""
    if not concurrencies:
        raise UserError("concurrencies is empty: give at least one, e.g. [1, 4, 8]")
    runs = [run_chat_load(url, c, requests, payloads, headers, timeout, warmup)
            for c in concurrencies]
    high = max(runs, key=lambda r: r["concurrency"])
    low = min(runs, key=lambda r: r["concurrency"])
    ratio = (round(high["tokens_per_s"] / low["tokens_per_s"], 2)
             if low["tokens_per_s"] and high is not low else None)
    return {"url": url, "task": "causal-lm", "api": "openai-chat", "runs": runs,
            "tokens_per_s_ratio": ratio}


def format_chat_table(result: dict) -> str:
    """A fixed-width table of a `sweep_chat` result."""
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("ok", "ok"),
               ("errors", "errors"), ("tok/s", "tokens_per_s"),
               ("ttft p50 ms", "ttft_ms_p50"), ("ttft p99 ms", "ttft_ms_p99"),
               ("itl p50 ms", "itl_ms_p50"), ("itl p99 ms", "itl_ms_p99"),
               ("tokens/req", "tokens_per_request"), ("prompt tok", "prompt_tokens_mean"),
               ("tokens from", "tokens_from")]
    lines = fixed_width(columns, result["runs"], plain)
    ratio = result.get("tokens_per_s_ratio")
    if len(result["runs"]) > 1:
        levels = sorted(r["concurrency"] for r in result["runs"])
        lines.append(f"tokens/s at concurrency {levels[-1]} / concurrency {levels[0]}: "
                     + ("n/a" if ratio is None else f"{ratio:.2f}x"))
    return "\n".join(lines)
