"""A started TorchServe (or LitServe, or Ray Serve application) recorded until it is ready,
whether a recorded one is still the one compress started, and stopping it.

`server.json` records the pid of TorchServe's Java frontend (or of compress's LitServe
process, `compress.serving.litserve.main`, or of the process that holds a Ray Serve
application, `compress.serving.ray.main`, which removes what it started on SIGTERM), its
process group and what identifies that process: the boot it ran in
(/proc/sys/kernel/random/boot_id) and its start time (field 22 of /proc/<pid>/stat). A pid
is signalled only while these match and its command line is the server's with this serve
folder in it; a record that no longer matches (written before a restart, or its pid now
another program's) is stale: it is removed and nothing is signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.serving.serve_folder import (
    KEY_FILE,
    SERVER_INFO,
    read_info,
    record_server,
    registry_dir,
    remove_server_temp,
    write_info,
)
from compress.system import processes

# in the command line of TorchServe's frontend, of compress's LitServe server, or of the
# process that holds compress's Ray Serve application (and the local cluster it started)
MARKERS = ("org.pytorch.serve.ModelServer", "compress.serving.litserve.main",
           "compress.serving.ray.main")
SERVE_DIR_ENV = "COMPRESS_SERVE_DIR"  # set for the launch: the server's processes inherit it


def identity(pid: int) -> dict[str, Any]:
    """What identifies process `pid` across pid reuse and restarts, for server.json."""
    stat = processes.stat(pid)
    return {"boot_id": processes.boot_id(), "pid_start": stat.start_ticks if stat else None}


def stale_reason(info: dict[str, Any]) -> str | None:
    """Why the record `info` no longer describes the server compress started (None: it
    does, or its server is gone and left nothing to identify)."""
    pid, recorded_boot, now_boot = int(info["pid"]), info.get("boot_id"), processes.boot_id()
    if recorded_boot and now_boot and recorded_boot != now_boot:
        return "written before the machine restarted"
    if not processes.alive(pid):
        return None
    stat = processes.stat(pid)
    if info.get("pid_start") is not None and (stat is None
                                              or stat.start_ticks != info["pid_start"]):
        return f"pid {pid} is now another process"
    command = processes.command_line(pid)
    if not any(m in command for m in MARKERS) or str(info.get("serve_dir")) not in command:
        return f"pid {pid} is not this folder's server"
    if stat is not None and info.get("pgid") is not None and stat.pgid != info["pgid"]:
        return f"pid {pid} left its process group"
    return None


def record_until_ready(serve_dir: Path, info: dict[str, Any], wait_ready: Callable[[], None],
                       token: Callable[[], str] | None) -> dict[str, Any]:
    """What every engine's launcher does once its server runs: record it (server.json, the
    registry), wait until it is ready (stopping it on any failure), then add its inference
    token, when `token` reads one; server.json as it ends."""
    record_server(serve_dir, info)
    try:
        wait_ready()
    except BaseException:
        stop(serve_dir)
        raise
    if token is not None:
        info["token"] = token()
        write_info(serve_dir, info)
    return info


def serving(info: dict[str, Any] | None) -> bool:
    """Whether the record `info` names a live server that compress started."""
    return bool(info) and processes.alive(int(info["pid"])) and stale_reason(info) is None


def stop(serve_dir: Path, grace_s: float = 30,
         echo: Callable[[str], None] = print) -> bool:
    """Stop the server of `serve_dir` and every process it started; True if one ran. A
    stale record is removed, said through `echo`, and nothing is signalled."""
    info = read_info(serve_dir)
    if not info:
        return False
    info.setdefault("serve_dir", str(Path(serve_dir).resolve()))
    reason = stale_reason(info)
    if reason:
        echo(f"{serve_dir}: stale server record ({reason}); removed it, signalled nothing")
        _forget(serve_dir, info)
        return False
    ran = processes.alive(info["pid"])
    if ran:
        os.kill(info["pid"], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while processes.alive(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    if ran or _group_is_ours(info["pgid"], info["serve_dir"]):
        kill_group(info["pgid"])  # workers left behind, if any
    _forget(serve_dir, info)
    return ran


def stop_servers(target: str | None, echo: Callable[[str], None] = print) -> list[str]:
    """Stop the server of `target` (a run folder or .mar), or every server compress started
    on this machine; return the serve folders that were running."""
    if target is not None:
        path = Path(target).resolve()
        folder = path.with_suffix(".serve") if path.suffix == ".mar" else path / "serve"
        return [str(folder)] if stop(folder, echo=echo) else []
    stopped = []
    for entry in sorted(registry_dir().glob("*.json")):
        try:
            folder = Path(json.loads(entry.read_text())["serve_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            folder = None
        if folder is not None and stop(folder, echo=echo):
            stopped.append(str(folder))
        entry.unlink(missing_ok=True)
    return stopped


def kill_group(pgid: int) -> None:
    """SIGKILL process group `pgid` and wait until it is gone (SIGKILL lands later: until
    then its processes hold their ports)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    _wait_group_gone(pgid)


def _group_is_ours(pgid: int, serve_dir: str) -> bool:
    """Whether a process of group `pgid` is left by the server of `serve_dir` (its
    frontend gone): one carries the folder in its command line or environment."""
    mark = f"{SERVE_DIR_ENV}={serve_dir}".encode()
    return any(serve_dir in processes.command_line(pid) or mark in processes.environment(pid)
               for pid in processes.group_members(pgid))


def _wait_group_gone(pgid: int, timeout_s: float = 10) -> None:
    """Wait until no live (non-zombie) process is left in group `pgid`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not processes.group_members(pgid):
            return
        time.sleep(0.05)


def _forget(serve_dir: Path, info: dict[str, Any]) -> None:
    """Remove the record of a server whose processes are gone, and what they unpacked."""
    for name in (SERVER_INFO, KEY_FILE):
        (Path(serve_dir) / name).unlink(missing_ok=True)
    remove_server_temp(info.get("temp_dir"))
    (registry_dir() / f"{info['pid']}.json").unlink(missing_ok=True)
