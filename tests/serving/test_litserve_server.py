"""The LitServe engine serving the tiny packaged classifier as a user's server runs: every
process of it has umask 0o077 and every Unix socket it listens on is private to the user;
a SIGKILLed worker ends the requests it held with a 5xx (none hangs), comes back by itself,
and requests succeed again."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from conftest import unix_sockets

pytest.importorskip("litserve")

from benchmarks.soak import run as soak  # noqa: E402
from compress.serving import server  # noqa: E402

pytestmark = pytest.mark.serving


@pytest.fixture(scope="module")
def served(packaged_text_run: Path, state_dir) -> dict:
    target = server.resolve_target(packaged_text_run / "03-package/tiny_onnx.mar")
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=180, echo=lambda _: None,
                        engine="litserve")
    yield info
    server.stop(target.serve_dir)


def _private(path: Path) -> bool:
    """Nobody but the user can reach `path`: it, or the folder it is in, grants nothing to
    group or others."""
    return not (path.stat().st_mode & 0o077) or not (path.parent.stat().st_mode & 0o077)


def test_the_servers_processes_and_sockets_are_private_to_the_user(served: dict) -> None:
    pids = soak.group_pids(served["pid"])
    assert len(pids) >= 3  # the server, LitServe's manager, the API server, the worker
    masks = {pid: next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                       .splitlines() if line.startswith("Umask:")) for pid in pids}
    assert set(masks.values()) == {"0077"}, masks
    sockets = unix_sockets(pids)
    assert sockets, "LitServe's queues use no Unix socket?"
    assert all(_private(Path(p)) for p in sockets), {
        p: oct(stat.S_IMODE(Path(p).stat().st_mode)) for p in sockets}
    log = Path(served["serve_dir"]) / "logs" / "model_log.log"
    assert stat.S_IMODE(log.stat().st_mode) & 0o077 == 0


def test_a_killed_worker_ends_its_requests_with_5xx_and_comes_back(served: dict) -> None:
    before = soak.worker_pids(served["pid"])
    assert len(before) == 1
    # the new worker loads the model again (8 s on 2 busy cores): requests sent meanwhile
    # wait for it in the queue; none may wait for the client's timeout
    figures = soak.kill_worker(served, seconds=20, kill_at=2, concurrency=4, timeout=30)
    print("LitServe worker SIGKILLed:", figures)
    assert figures["hung"] == 0 and figures["longest_s"] < 30, figures
    assert all(f.startswith("HTTP 5") for f in figures["failures"]), figures
    assert figures["worker_back_s"] is not None, figures
    assert figures["success_again_s"] is not None, figures
    assert figures["requests"] > figures["failed"]
    after = soak.worker_pids(served["pid"])
    assert len(after) == 1 and not set(after) & set(before)
    assert soak.soak(served, requests=50, concurrency=4, warmup=0)["errors"] == 0
