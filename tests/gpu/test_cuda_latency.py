"""The latency harness on CUDA: a call is timed until its kernels end, not until they are
queued (CUDA launches return at once)."""

from __future__ import annotations

import torch

from compress.measure.latency import measure_latency


def test_cuda_latency_counts_the_kernels_not_their_launch() -> None:
    a = torch.randn(4096, 4096, device="cuda")

    def work(x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = x @ a
            x = x / x.norm()
        return x

    work(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work(a)
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end)
    assert gpu_ms > 1.0  # 20 products of 4096^3: milliseconds of GPU work
    figures = measure_latency(work, lambda batch: a[:batch * 512], [8], warmup=2, iters=10,
                              threads=None)
    # unsynchronized, the harness would report the launches only (tens of microseconds)
    assert figures["latency_ms_b8"] >= 0.7 * gpu_ms, (figures, gpu_ms)
    assert figures["latency_ms_b8_p90"] >= figures["latency_ms_b8"]
