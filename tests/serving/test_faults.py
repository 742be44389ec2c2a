"""The classifier archive under faults, at CI size (benchmarks/soak/run.py runs the large
ones): a load of 600 requests at concurrency 16 with no error and its memory measured; the
worker SIGKILLed in the middle of a load: no request hangs, each either succeeds or fails, a
new worker comes by itself and requests succeed again."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ts")

from benchmarks.soak import run as soak  # noqa: E402
from compress.serving import server  # noqa: E402

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def served(packaged_text_run: Path, state_dir) -> dict:
    target = server.resolve_target(packaged_text_run / "03-package/tiny_onnx.mar")
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=180, echo=lambda _: None)
    yield info
    server.stop(target.serve_dir)


def test_a_load_has_no_error_and_its_memory_is_measured(served: dict) -> None:
    figures = soak.soak(served, requests=600, concurrency=16, warmup=100)
    assert figures["errors"] == 0 and figures["rps"] > 0
    assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    # benchmarks/soak/run.py measured 1.06 after 10,000 requests; 1.5 leaves room for the
    # allocator's noise and breaks if 600 requests add half the warmed-up memory (a server
    # of 400 MB keeping 0.33 MB a request: each request's tensors or bodies held on to)
    assert figures["rss_warm_mb"] > 50 and figures["rss_ratio"] <= 1.5, figures
    assert len(soak.worker_pids(served["pid"])) == 1


def test_a_killed_worker_fails_requests_without_hanging_and_comes_back(served: dict) -> None:
    """Requests in flight fail (HTTP 507) and the worker comes back by itself. TorchServe
    0.12 loses the requests it was collecting into a batch when the worker dies then (at
    most a batch, 8 here: see benchmarks/soak/run.py's `kill_worker`); they end at the
    client's timeout, and the clients go on."""
    before = soak.worker_pids(served["pid"])
    concurrency, timeout = 4, 6
    figures = soak.kill_worker(served, seconds=18, kill_at=2, concurrency=concurrency,
                               timeout=timeout)
    assert figures["worker_back_s"] is not None, figures
    # a request hangs only when the dead worker strands it: sent under a second before the
    # kill (in flight: a request takes milliseconds) or after it, before the new worker was
    # up (0.22-0.24 s after the kill, worker back at 1.26 s, measured: later ones get 507
    # or an answer); each client has one request in flight, so at most one a client every
    # `timeout` in that window. Every other request is answered (an error or not) in time
    back = figures["worker_back_s"]
    assert all(-1 < s <= back for s in figures["hung_started_s"]), figures
    stranded = concurrency * (1 + int((back + 1) // timeout))
    assert figures["hung"] <= min(8, stranded) and figures["longest_s"] < timeout + 1, figures
    assert figures["success_again_s"] is not None, figures
    assert figures["requests"] > figures["failed"]
    after = soak.worker_pids(served["pid"])
    assert after and not set(after) & set(before)
    assert soak.soak(served, requests=50, concurrency=4, warmup=0)["errors"] == 0
