"""A killed worker's own temporary folder goes at the next worker's start, and each goes at
its exit (serve/worker_temp.py, issue 70, item 10), as TorchServe restarts workers: two real
Python processes that import torch, so an integration test (the other worker-folder checks
are in tests/unit/test_worker_temp.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from builders import shipped_graphs

REPO = Path(__file__).resolve().parents[2]


WORKER = """
import os, signal, sys
from pathlib import Path
from serve.causal_lm.server import compiled_graphs
said = compiled_graphs.use_shipped(Path(sys.argv[1]), None)[-1]
print(said, os.environ["TORCHINDUCTOR_CACHE_DIR"], flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_workers_copy_goes_at_the_next_start_and_each_at_its_exit(tmp_path) -> None:
    """As TorchServe restarts a worker: the first is SIGKILLed after it copied the shipped
    cache, the next one starts in the same server folder and then exits normally; nothing
    of either is left."""
    shipped, temp = shipped_graphs(tmp_path), tmp_path / "server-temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env |= {"TMPDIR": str(temp), "PYTHONPATH": str(REPO)}
    copies = []
    for end in ("killed", "exits"):
        done = subprocess.run([sys.executable, "-c", WORKER, str(shipped), end], env=env,
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        assert done.returncode == (-signal.SIGKILL if end == "killed" else 0), done.stderr
        said, _, copy = done.stdout.strip().rpartition(" ")
        assert said == "shipped compiled graphs used", done.stdout
        copies.append(Path(copy))
    assert all(copy.is_relative_to(temp) for copy in copies), copies  # in the server's folder
    left = sorted(str(p.relative_to(temp)) for p in temp.rglob("*"))
    assert left == [], left
