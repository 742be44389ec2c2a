"""The CPU each process of this machine has used, read from /proc (standard library only):
`read_process` (a process's parent, start, CPU seconds, name and command line) and
`cpu_spent` (each process's CPU between two readings, by what it is)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def read_process(pid: str) -> dict[str, Any] | None:
    """A process's parent, start (seconds after boot), CPU seconds, name and command line
    (None where it ended meanwhile)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return {"pid": int(pid), "ppid": int(fields[1]), "start": int(fields[19]) / TICK,
            "cpu_s": (int(fields[11]) + int(fields[12])) / TICK, "name": name,
            "command": command.replace(b"\0", b" ").decode(errors="replace").strip()[:400]}


def reading() -> dict[tuple[int, float], dict[str, Any]]:
    """Every process now, by (pid, start)."""
    found = (read_process(pid) for pid in os.listdir("/proc") if pid.isdigit())
    return {(row["pid"], row["start"]): row for row in found if row is not None}


def ray_or_named(row: dict[str, Any]) -> str:
    """What a serving process is: a Ray actor's class (`ray::ProxyActor`), else its
    module (`-m ...`), script or executable name."""
    command = row["command"]
    if command.startswith("ray::"):
        return command.split(":")[0] + "::" + command.split(":")[2]
    if (module := re.search(r" -m ([\w.]+)", command)) is not None:
        return module.group(1)
    if "multiprocessing.spawn" in command or "multiprocessing.forkserver" in command:
        return f"{row['name']} (multiprocessing child)"
    first = command.split(" ")[0] if command else row["name"]
    script = next((Path(p).name for p in command.split(" ")[1:3] if p.endswith(".py")), None)
    return script or Path(first).name or row["name"]


def cpu_spent(before: dict[tuple[int, float], dict[str, Any]],
              after: dict[tuple[int, float], dict[str, Any]],
              kind: Callable[[dict[str, Any]], str] = ray_or_named) -> dict[str, float]:
    """CPU seconds each kind of process used between two `reading`s (a process that
    started between them counts from 0; one that ended is lost), largest first."""
    spent: dict[str, float] = {}
    for key, row in after.items():
        used = row["cpu_s"] - (before[key]["cpu_s"] if key in before else 0.0)
        if used > 0:
            spent[kind(row)] = spent.get(kind(row), 0.0) + used
    return dict(sorted(spent.items(), key=lambda item: -item[1]))
