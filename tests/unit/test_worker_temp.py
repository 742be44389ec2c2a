"""A worker's own temporary folder (serve/worker_temp.py, issue 70, item 10): what a worker
unpacks (AOTInductor's extraction of a `.pt2`, the copy of a shipped Inductor cache) lies in
a folder named for its pid and start time, removed at its exit, and, where it was killed,
by the next worker; a live worker's folder is never touched. The restart itself (two real
workers, one killed) is tests/integration/test_worker_temp_restart.py."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from builders import shipped_graphs

from serve import runtimes, worker_temp
from serve.causal_lm.server import aot_steps, compiled_graphs


@pytest.fixture
def temp(tmp_path, monkeypatch) -> Path:
    """A fresh TMPDIR for this process, with no worker folder made yet."""
    folder = tmp_path / "server-temp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setattr(worker_temp, "_made", {})
    return folder


def _killed_unreaped() -> tuple[subprocess.Popen, int]:
    """A child SIGKILLed and not reaped yet (a zombie, as a killed TorchServe worker is until
    Java waits for it), and when it started."""
    child = subprocess.Popen(["sleep", "60"])
    ticks = worker_temp.start_ticks(child.pid)
    child.kill()
    deadline = time.monotonic() + 10
    while worker_temp.start_ticks(child.pid) is not None:
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)
    assert ticks
    return child, ticks


def test_dead_owners_folders_are_swept_and_live_ones_kept(temp: Path) -> None:
    live = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["sleep", "60"])
    try:
        gone_ticks = worker_temp.start_ticks(gone.pid)
        gone.kill()
        gone.wait()
        zombie, zombie_ticks = _killed_unreaped()
        live_ticks = worker_temp.start_ticks(live.pid)
        assert live_ticks and gone_ticks
        names = {
            "live": worker_temp.name_of(live.pid, live_ticks),
            "gone": worker_temp.name_of(gone.pid, gone_ticks),
            "zombie": worker_temp.name_of(zombie.pid, zombie_ticks),
            "reused pid": worker_temp.name_of(live.pid, live_ticks + 1),
            "not ours": f"{worker_temp.PREFIX}notes",
        }
        for name in names.values():
            (temp / name / "aotinductor_x").mkdir(parents=True)
        own = worker_temp.folder()
        zombie.wait()
    finally:
        live.kill()
        live.wait()
    assert own == temp / worker_temp.name_of(os.getpid(), worker_temp.start_ticks(os.getpid()))
    assert sorted(p.name for p in temp.iterdir()) == sorted(
        [names["live"], names["not ours"], own.name])
    assert worker_temp.folder() == own  # made once a process
    assert worker_temp.sweep(temp) == [temp / names["live"]]  # its owner has ended now


def test_packages_extract_into_the_workers_folder(temp: Path, tmp_path, monkeypatch) -> None:
    """AOTInductor's loader extracts into TMPDIR as it is when the package loads (checked
    with a real package in tests/integration/test_aot_steps.py): both loaders point it at
    the worker's folder for that call only."""
    seen = []

    class Loader:  # AOTInductor's C++ loader, as `serve/aoti_package.py` calls it
        def __init__(self, path: str, model: str, *args: object) -> None:
            seen.append((os.environ["TMPDIR"], Path(path).name, model))

        def get_call_spec(self) -> list[str]:
            return ["", torch.utils._pytree.treespec_dumps(
                torch.utils._pytree.tree_flatten(torch.zeros(1))[1])]

        def get_constant_fqns(self) -> list[str]:
            return []

        def load_constants(self, *args: object) -> None:
            pass

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Loader)
    monkeypatch.setattr(aot_steps, "operators_loaded", lambda: False)  # the binding's path
    runtimes.load_aoti(tmp_path / "model.aoti.pt2", {}, 1, False)
    (tmp_path / aot_steps.ONE).write_bytes(b"")
    assert list(aot_steps.load_steps(tmp_path, torch.nn.Linear(2, 2))) == [1]
    own = str(worker_temp.folder())
    assert seen == [(own, "model.aoti.pt2", "model"), (own, aot_steps.ONE, "model")]
    assert os.environ["TMPDIR"] == str(temp)


def test_the_shipped_inductor_cache_is_copied_into_the_workers_folder(temp: Path,
                                                                     tmp_path) -> None:
    shipped = shipped_graphs(tmp_path)
    assert compiled_graphs.use_shipped(shipped, None)[-1] == "shipped compiled graphs used"
    cache = Path(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"))
    assert cache.parent == worker_temp.folder() and (cache / "fxgraph" / "entry").is_file()
