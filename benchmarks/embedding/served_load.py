"""The load of benchmarks/embedding/served.py: OpenAI `embeddings.create` calls through the
`openai` client (one AsyncOpenAI, `concurrency` calls in flight until `requests` were
made, `warmup` calls first and not counted), the same for every server: compress's
`.../predictions/MODEL/VERSION/v1` and infinity-emb's `.../v1`.

Each call embeds `inputs` texts of the eval split (cycled in order, so no two calls in a
level send the same texts while there are enough). Figures of a level: embeddings/s (every
embedding returned over the level's wall time), requests/s, latency p50 / p99 (from the
call to its parsed answer, nearest rank), errors and a few of their messages.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from compress.serving.loadtest.workers import percentile

ERROR_EXAMPLES = 3


def batches_of(texts: list[str], inputs: int, count: int, start: int = 0) -> list[list[str]]:
    """`count` calls' inputs: `inputs` texts each, taken in order from `start`, cycling."""
    if not texts:
        raise ValueError("no texts to send")
    return [[texts[(start + i * inputs + j) % len(texts)] for j in range(inputs)]
            for i in range(count)]


def level_figures(latencies_ms: list[float], embeddings: int, errors: list[str],
                  concurrency: int, requests: int, wall_s: float) -> dict[str, Any]:
    """The figures of one level from its calls (the latencies of the good ones)."""
    ordered = sorted(latencies_ms)
    return {"concurrency": concurrency, "requests": requests, "ok": len(ordered),
            "errors": len(errors), "error_examples": sorted(set(errors))[:ERROR_EXAMPLES],
            "wall_s": round(wall_s, 3),
            "embeddings_per_s": round(embeddings / wall_s, 2) if wall_s > 0 else None,
            "requests_per_s": round(len(ordered) / wall_s, 2) if wall_s > 0 else None,
            "latency_ms_p50": percentile(ordered, 50),
            "latency_ms_p99": percentile(ordered, 99)}


async def _drive(client: Any, model: str, calls: list[list[str]], concurrency: int,
                 encoding: str) -> tuple[list[float], int, list[str], float]:
    """Make `calls` with `concurrency` in flight; (latencies, embeddings, errors, wall)."""
    latencies: list[float] = []
    errors: list[str] = []
    embedded = 0
    queue = iter(calls)

    async def worker() -> None:
        nonlocal embedded
        for texts in queue:
            began = time.perf_counter()
            try:
                answer = await client.embeddings.create(model=model, input=texts,
                                                        encoding_format=encoding)
                if len(answer.data) != len(texts):
                    raise ValueError(f"{len(answer.data)} embeddings for {len(texts)} inputs")
            except Exception as exc:  # noqa: BLE001 - counted; the level goes on
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                continue
            latencies.append(1000 * (time.perf_counter() - began))
            embedded += len(answer.data)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(calls)))))
    return latencies, embedded, errors, time.perf_counter() - began


async def _levels(base_url: str, model: str, texts: list[str], levels: list[int],
                  requests: int, inputs: int, encoding: str, timeout: float
                  ) -> list[dict[str, Any]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout)
    out, start = [], 0
    try:
        for level in levels:
            warm = batches_of(texts, inputs, level, start)
            await _drive(client, model, warm, level, encoding)
            calls = batches_of(texts, inputs, requests, start + level * inputs)
            start += (level + requests) * inputs
            latencies, embedded, errors, wall = await _drive(client, model, calls, level,
                                                             encoding)
            out.append(level_figures(latencies, embedded, errors, level, requests, wall))
    finally:
        await client.close()
    return out


def run_levels(base_url: str, model: str, texts: list[str], levels: list[int], requests: int,
               inputs: int = 1, encoding: str = "base64", timeout: float = 300.0
               ) -> list[dict[str, Any]]:
    """Each level's figures, in order: `level` warm-up calls, then `requests` measured."""
    return asyncio.run(_levels(base_url, model, texts, levels, requests, inputs, encoding,
                               timeout))


def probe(base_url: str, model: str, timeout: float) -> str | None:
    """None when one embedding call is answered, else why not (one line)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout)
    try:
        client.embeddings.create(model=model, input=["ready?"])
        return None
    except Exception as exc:  # noqa: BLE001 - the caller retries until its deadline
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        client.close()
