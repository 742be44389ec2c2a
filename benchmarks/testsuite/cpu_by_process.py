"""Where a command's CPU goes, process by process: the test suite's by default (the
README's test command), or any command after `--`. Every second it reads each process's
utime + stime and command line from /proc (a process loses at most its last second), and
at the end sums the CPU of the processes started while the command ran by what they are:
`compress run`, the pytest-xdist workers (tests run in process), TorchServe, LitServe and
torchrun processes, and compilers, each charged to its first ancestor that is not one
(ninja: a kernel library's build; a Python process: Inductor / AOTInductor compiling for
it). On a machine of 2 cores the suite keeps both busy, so its time is its CPU: this says
what to cut.

    python -m benchmarks.testsuite.cpu_by_process
    python -m benchmarks.testsuite.cpu_by_process --json cpu.json -- python -m pytest tests/unit -q
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.harness.process_cpu import read_process

SUITE = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
COMPILERS = {"cc1plus", "cc1", "as", "ld", "collect2", "g++", "c++", "gcc", "sh", "ninja",
             "x86_64-linux-gn"}
PYTHON_KINDS = ("torch.distributed.run", "model_service_worker", "multiprocessing.spawn",
                "resource_tracker", "compress.serving.litserve", "model_archiver")
def sample(seen: dict[tuple[int, float], dict[str, Any]], after: float) -> None:
    """Add or update every process that started at or after `after` (seconds after boot)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            found = read_process(pid)
            if found is not None and found["start"] >= after:
                seen[(found["pid"], found["start"])] = found


def python_kind(command: str) -> str:
    """What a Python process is, from its command line."""
    if "exec(eval(sys.stdin.readline()))" in command:
        return "pytest-xdist worker (tests in process)"
    if (match := re.search(r"-m compress (\w+)", command)) is not None:
        return f"compress {match.group(1)}"
    return next((kind for kind in PYTHON_KINDS if kind in command),
                "python: " + " ".join(command.split()[1:3])[:50])


def kinds(rows: list[dict[str, Any]]) -> Counter:
    """CPU seconds by kind of process; a compiler's go to its first non-compiler ancestor."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_pid.setdefault(row["pid"], []).append(row)

    def parent(row: dict[str, Any]) -> dict[str, Any] | None:
        older = [p for p in by_pid.get(row["ppid"], []) if p["start"] <= row["start"]]
        return max(older, key=lambda p: p["start"]) if older else None

    def kind(row: dict[str, Any]) -> str:
        if row["name"] in COMPILERS:
            ancestor: dict[str, Any] | None = row
            while ancestor is not None and ancestor["name"] in COMPILERS:
                if ancestor["name"] == "ninja":
                    return "compiler under ninja (kernel library builds)"
                ancestor = parent(ancestor)
            return "compiler under " + (python_kind(ancestor["command"]) if ancestor
                                        else "a process that ended unseen")
        if row["name"] == "java":
            return "java (TorchServe)"
        if "python" in row["name"] or "python" in row["command"].split(" ")[0]:
            return python_kind(row["command"])
        return "other: " + row["name"]

    total: Counter = Counter()
    for row in rows:
        total[kind(row)] += row["cpu_s"]
    return total


def boot_seconds() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="every process seen, with its CPU seconds")
    parser.add_argument("--top", type=int, default=25, help="kinds listed (25)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the command (default: the README's test command)")
    args = parser.parse_args(argv)
    command = [c for c in args.command if c != "--"] or SUITE
    began, wall = boot_seconds() - 1, time.monotonic()
    seen: dict[tuple[int, float], dict[str, Any]] = {}
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen, began)
        time.sleep(1)
    rows = list(seen.values())
    total = kinds(rows)
    cpu = sum(total.values())
    print(f"{' '.join(command)}: exit {child.returncode}, {time.monotonic() - wall:.0f} s wall, "
          f"{cpu:.0f} s of CPU in {len(rows)} processes started meanwhile (on "
          f"{os.cpu_count()} cores)")
    for name, seconds in total.most_common(args.top):
        print(f"{seconds:8.0f} s {100 * seconds / max(cpu, 1e-9):5.1f}%  {name}")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
