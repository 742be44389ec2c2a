"""Package stage: the .mar's contents and settings, and the batching handler run in this
process with TorchServe's own Context (no server: tests/serving starts a real one)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ts")


from serve.classifier.handler import worker_threads  # noqa: E402


def test_worker_threads_never_exceed_the_cores() -> None:
    cores = os.cpu_count() or 1
    assert worker_threads(None, 1) == cores
    assert worker_threads(64, 1) == cores
    assert worker_threads(1, 1) == 1
    assert worker_threads(None, cores * 2) == 1


