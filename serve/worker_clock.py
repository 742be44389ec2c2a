"""How long this worker process has lived (the standard library only: shipped in every
archive beside its handler): the handlers stamp their start-up progress lines with it, so
the model log says where a cold start goes (imports before the handler runs, loading, the
compiled steps, warm-ups)."""

from __future__ import annotations

import os
import time


def seconds_alive() -> float | None:
    """Seconds since this process started (/proc/self/stat's start time against the boot
    clock); None where /proc does not say."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def stamped(message: str) -> str:
    """`message` with the process's age: "loading x (at 3.2 s)"."""
    alive = seconds_alive()
    return message if alive is None else f"{message} (at {alive:.1f} s)"
