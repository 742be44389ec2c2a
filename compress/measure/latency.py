"""The latency harness: warm-up, fixed thread count, median and p90 of N timed runs."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

NOISY_SPREAD = 0.25  # (p90 - p50) / p50 above this marks a measurement noisy


@contextlib.contextmanager
def fixed_threads(threads: int | None) -> Iterator[int]:
    """Run the block with `threads` intra-op threads (default: all cores), then restore."""
    before = torch.get_num_threads()
    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


def time_call(fn: Callable[[], Any], warmup: int, iters: int) -> dict[str, float]:
    """Median, p90, min and spread (ms) of `iters` calls of `fn` after `warmup` calls. Where
    CUDA is in use, each call is timed from an idle GPU until its kernels have finished
    (CUDA launches return before the work is done)."""
    for _ in range(warmup):
        fn()
    sync = _synchronize()
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1000)
    return summarize(samples)


def _synchronize() -> Callable[[], None]:
    """`torch.cuda.synchronize` once this process has used CUDA, else a no-op."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.synchronize
    return lambda: None


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, p90, min and noisy (p90 more than NOISY_SPREAD above the median) of timings."""
    ordered = sorted(samples)
    median = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"p50": median, "p90": p90, "min": ordered[0],
            "noisy": bool(median and (p90 - median) / median > NOISY_SPREAD)}


def measure_latency(run: Callable[[Any], Any], make_inputs: Callable[[int], Any],
                    batch_sizes: list[int], warmup: int, iters: int,
                    threads: int | None, suffix: str = "") -> dict[str, Any]:
    """`latency_ms_b{N}{suffix}` (median) and `latency_ms_b{N}{suffix}_p90` for each batch
    size, with `latency_threads` and (when any) `latency_noisy_batches`."""
    metrics: dict[str, Any] = {}
    noisy = []
    with fixed_threads(threads) as count, torch.inference_mode():
        for batch in batch_sizes:
            inputs = make_inputs(batch)
            stats = time_call(lambda inputs=inputs: run(inputs), warmup, iters)
            metrics[f"latency_ms_b{batch}{suffix}"] = round(stats["p50"], 3)
            metrics[f"latency_ms_b{batch}{suffix}_p90"] = round(stats["p90"], 3)
            if stats["noisy"]:
                noisy.append(batch)
        metrics["latency_threads"] = count
    if noisy:
        metrics["latency_noisy_batches"] = noisy
    return metrics
