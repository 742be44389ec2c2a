"""This machine's processes as Linux's /proc shows them: every process id, whether one is
alive, its state, process group and start time (`/proc/<pid>/stat`), its command line,
environment, children and whole tree, the TCP sockets a tree listens on, this boot's id,
this process's peak resident memory, and a process's or a tree's proportional set size.

Where /proc does not say (another OS, a process that ended meanwhile, another user's
environment) each answers None, "" or nothing rather than raising.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
ENDED = ("Z", "X")  # a zombie (exited, not reaped yet) and a dead process


@dataclass(frozen=True)
class ProcessStat:
    """What compress reads of `/proc/<pid>/stat` (fields 3, 5 and 22)."""

    state: str  # R running, S sleeping, Z zombie...
    pgid: int  # its process group
    start_ticks: int  # when it started, in clock ticks since boot


def boot_id() -> str | None:
    """This boot's id (None where /proc does not say)."""
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None


def pids() -> list[int]:
    """The id of every process on this machine (none where /proc cannot be read)."""
    try:
        return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return []


def stat(pid: int) -> ProcessStat | None:
    """Process `pid`'s state, group and start time (None: gone, or no /proc)."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return ProcessStat(state=fields[0], pgid=int(fields[2]), start_ticks=int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def command_line(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" where unreadable)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def environment(pid: int) -> list[bytes]:
    """Process `pid`'s environment, one `NAME=value` entry each (none where unreadable)."""
    try:
        return (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The processes that process `pid` (any of its threads) started."""
    found: list[int] = []
    for listing in (PROC / str(pid) / "task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(child) for child in listing.read_text().split()]
    return found


def tree(pid: int) -> list[int]:
    """Process `pid` and every process it started, and they started, down to the leaves."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.append(current)
            todo += children(current)
    return found


@dataclass(frozen=True)
class Listener:
    """A TCP socket in LISTEN state, and one process that holds it."""

    pid: int
    address: str  # as ipaddress writes it: "127.0.0.1", "::1", "0.0.0.0", "::"
    port: int

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach it (127.0.0.0/8, ::1, ::ffff:127.x.y.z)."""
        address = ipaddress.ip_address(self.address)
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        command = " ".join(command_line(self.pid).split())
        return f"{host}:{self.port} (pid {self.pid}: {command[:100]})"


LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def _address(hex_address: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} ("0100007F:1F90": 32-bit words in this machine's
    byte order, then the port) as ("127.0.0.1", 8080)."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open (none where unreadable)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in (PROC / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    found.add(int(target[8:-1]))
    return found


def listeners(pids: list[int]) -> list[Listener]:
    """Every TCP socket (IPv4 and IPv6) in LISTEN state that one of `pids` holds open: the
    socket inodes of /proc/PID/fd looked up in /proc/PID/net/tcp and tcp6 (the process's
    own network namespace)."""
    found: list[Listener] = []
    for pid in pids:
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        for table in ("tcp", "tcp6"):
            try:
                rows = (PROC / str(pid) / "net" / table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and fields[3] == LISTEN and int(fields[9]) in inodes:
                    found.append(Listener(pid, *_address(fields[1])))
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    found = stat(pid)
    return found is None or found.state not in ENDED


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group `pgid`."""
    return [pid for pid in pids()
            if (found := stat(pid)) is not None and found.pgid == pgid
            and found.state not in ENDED]


def reset_peak_rss() -> bool:
    """Start a new peak of this process's resident memory (clear_refs 5 resets VmHWM).
    False where the kernel refused (a container without the right to write clear_refs):
    the peak then still counts from the process's start."""
    try:
        (PROC / "self" / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float | None:
    """Peak resident memory of this process since the last reset, in MB (None where /proc
    does not say)."""
    try:
        for line in (PROC / "self" / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def pss_bytes(pid: int) -> int:
    """Process `pid`'s proportional set size in bytes (`/proc/<pid>/smaps_rollup`: each
    page it maps divided by the processes that map it, so a tree's sum counts a shared page
    once); 0 where /proc does not say (it ended, another user's)."""
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def tree_pss_bytes(pid: int) -> dict[int, int]:
    """PSS in bytes of process `pid` and of each process it started, by process id (their
    sum is the tree's memory, shared pages once)."""
    return {member: pss_bytes(member) for member in tree(pid)}
