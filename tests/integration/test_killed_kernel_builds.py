"""A kernel build killed midway (a test timed out, a worker was stopped) leaves its build
folder's `lock` behind; torch's `cpp_extension.load` then waits on it forever, so every later
first use of the kernels hung, pytest's collection included. Both loaders (the causal LM's
grouped kernels and the encoder's attention kernels) now remove a lock no live process
holds, and a lock a live build holds stays."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serve.causal_lm.runtime.kernels import unheld_lock_removed

LOADERS = {  # module, its load call, its build name
    "grouped": ("serve.causal_lm.runtime.kernels", "grouped_mm_available",
                lambda m: m._build_name(m._cpu_flags())[0]),
    "encoder": ("serve.encoder_attention", "load", lambda m: m.library_name()[0]),
}
ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, extensions: Path) -> subprocess.Popen:
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(ROOT)}
    env.pop("COMPRESS_NO_KERNELS", None)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_lock_a_killed_build_left_does_not_hang_the_next_load(loader: str,
                                                                 tmp_path: Path) -> None:
    module_name, call, build_name = LOADERS[loader]
    module = importlib.import_module(module_name)
    assert getattr(module, call)(), "the kernels build here (a C++ compiler and ninja)"
    from torch.utils.cpp_extension import _get_build_directory

    name = build_name(module)
    extensions = tmp_path / "extensions"  # a copy of this CPU's build: the next load is quick
    shutil.copytree(_get_build_directory(name, verbose=False), extensions / name,
                    ignore=shutil.ignore_patterns("lock"))
    lock = extensions / name / "lock"
    killed = _child("import time; from torch.utils.file_baton import FileBaton; "  # as a
                    f"FileBaton({str(lock)!r}).try_acquire(); print(1, flush=True); "  # build
                    "time.sleep(60)", extensions)  # takes it, then is killed midway
    assert killed.stdout.readline().strip() == "1"
    killed.kill()
    killed.wait()
    assert lock.exists()  # what the killed build left

    load = _child(f"import {module_name} as m; print('loaded', m.{call}(), flush=True)",
                  extensions)
    try:
        out, err = load.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        load.kill()
        pytest.fail(f"the load waited on {lock} (torch's FileBaton) past 300 s")
    assert load.returncode == 0, err[-2000:]
    assert out.split() == ["loaded", "True"], (out, err[-2000:])
    assert "removed a killed build's lock" in err
    assert not lock.exists()


def test_a_lock_a_live_process_holds_stays(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    assert not unheld_lock_removed(lock)  # no lock: nothing to do
    descriptor = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton takes it
    try:
        assert not unheld_lock_removed(lock) and lock.exists()
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                                   f"f = open({str(lock)!r}); print(1, flush=True); "
                                   "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    finally:
        os.close(descriptor)
    try:
        holder.stdout.readline()  # another process has it open now
        assert not unheld_lock_removed(lock) and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert unheld_lock_removed(lock) and not lock.exists()
