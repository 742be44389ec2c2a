"""A worker's own temporary folder: what it unpacks goes there, and leaves with it.

A served worker unpacks files it runs from: AOTInductor extracts each `.pt2` it loads (its
shared library and weights: 60 MB for a SmolLM2 decode step) and a causal-LM worker copies
the Inductor cache its archive ships. TorchServe SIGKILLs a worker it restarts, so nothing
of that worker runs at its end, and its copies stayed in the server's temporary folder
until `compress serve --stop`.

Each process puts them in `<TMPDIR>/compress-worker-<pid>-<start>/` (`folder`), named for its
process id and its start time (field 22 of /proc/<pid>/stat, in clock ticks since boot).
The folder is removed when the process exits normally (atexit), and otherwise by the next
process that makes its own folder beside it (`sweep`): a folder whose process is gone or a
zombie, or whose pid now belongs to a process started at another time (a reused pid), is a
dead owner's; one whose pid and start time match a running process is left alone.
Standard library only: this module ships in every archive.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "compress-worker-"
ENDED = ("Z", "X")  # a zombie (killed, not reaped yet) and a dead process
_made: dict[int, Path] = {}  # by pid: a forked child makes its own


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (None: gone, ended, or no
    /proc to say)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ENDED:
        return None
    return int(fields[19])


def name_of(pid: int, ticks: int | None) -> str:
    """The folder name of process `pid` started at `ticks` (0 where /proc did not say)."""
    return f"{PREFIX}{pid}-{ticks or 0}"


def owner_alive(name: str) -> bool:
    """Whether the process a worker folder is named for still runs (a name that is not
    one of ours counts as alive: it is not ours to remove)."""
    pid_text, _, ticks_text = name.removeprefix(PREFIX).partition("-")
    if not name.startswith(PREFIX) or not (pid_text.isdigit() and ticks_text.isdigit()):
        return True
    pid, ticks = int(pid_text), int(ticks_text)
    if not Path("/proc/self/stat").exists():  # no /proc: whether the pid runs at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process runs under that pid
            pass
        return True
    return start_ticks(pid) == ticks if ticks else start_ticks(pid) is not None


def sweep(parent: Path | None = None) -> list[Path]:
    """Remove the worker folders in `parent` (TMPDIR) whose owner no longer runs; the
    folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for entry in parent.glob(f"{PREFIX}*"):
        if entry.is_dir() and not entry.is_symlink() and not owner_alive(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def folder() -> Path:
    """This process's own folder in TMPDIR, made (and the dead owners' folders beside it
    removed) on first use; removed when the process exits normally."""
    pid = os.getpid()
    made = _made.get(pid)
    if made is not None and made.is_dir():
        return made
    parent = Path(tempfile.gettempdir())
    sweep(parent)
    path = parent / name_of(pid, start_ticks(pid))
    path.mkdir(mode=0o700, exist_ok=True)
    if made is None:
        atexit.register(_remove, path, pid)
    _made[pid] = path
    return path


def _remove(path: Path, owner: int) -> None:
    """Remove `path` at exit, in the process that made it only (not in a forked child)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def extracting() -> Iterator[Path]:
    """TMPDIR names this process's folder while the block runs: AOTInductor's loader (C++)
    reads it when it extracts a package, and the package keeps its files there."""
    path = folder()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
