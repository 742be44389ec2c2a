"""compress.system.processes on real processes of this machine: a child's state, group,
start time, command line, environment and parent; a zombie and a reaped child count as
ended; the TCP sockets a process tree listens on, loopback told apart; this process's peak
resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compress.system import processes

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not processes.PROC.is_dir(), reason="needs Linux's /proc")


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    """A sleeping Python child in a process group of its own, with a marker in its
    command line and its environment."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "marker-arg"],
                            env={**os.environ, "PROCESSES_TEST_MARK": "1"},
                            start_new_session=True)
    # Popen returns once the exec began; its command line is readable a moment later (a
    # loaded CI machine read it empty)
    deadline = time.monotonic() + 10
    while "marker-arg" not in processes.command_line(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_a_child_is_read_whole(child: subprocess.Popen) -> None:
    stat = processes.stat(child.pid)
    assert stat is not None and stat.pgid == child.pid and stat.state not in processes.ENDED
    assert stat.start_ticks >= processes.stat(os.getpid()).start_ticks
    assert "marker-arg" in processes.command_line(child.pid)
    assert b"PROCESSES_TEST_MARK=1" in processes.environment(child.pid)
    assert child.pid in processes.children(os.getpid())
    assert child.pid in processes.pids() and processes.alive(child.pid)
    assert processes.group_members(child.pid) == [child.pid]
    assert processes.boot_id()


def test_a_zombie_and_a_reaped_child_have_ended(child: subprocess.Popen) -> None:
    child.kill()
    deadline = time.monotonic() + 10
    while processes.stat(child.pid).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not processes.alive(child.pid)  # a zombie: exited, not reaped yet
    assert processes.group_members(child.pid) == []
    child.wait()
    assert not processes.alive(child.pid) and processes.stat(child.pid) is None
    assert processes.command_line(child.pid) == "" and processes.environment(child.pid) == []


def test_the_peak_resident_memory_rises_with_what_is_held() -> None:
    # a fresh interpreter: this test process's own peak (models loaded by earlier tests)
    # would hide 64 MB where the kernel refuses clear_refs, as CI's container does
    script = ("from compress.system import processes\n"
              "reset = processes.reset_peak_rss()\n"
              "before = processes.peak_rss_mb()\n"
              "held = b'\\x01' * (64 * 1024 * 1024)\n"  # written, so resident
              "after = processes.peak_rss_mb()\n"
              "print(reset, before, after)\n")
    answer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, cwd=REPO).stdout.split()
    before, after = float(answer[1]), float(answer[2])
    assert answer[0] in ("True", "False") and before < 200
    assert after >= before + 50


LISTENING = """
import socket, subprocess, sys, time
socks = []
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"),
                     (socket.AF_INET6, "::1"), (socket.AF_INET6, "::")):
    try:
        s = socket.socket(family)
        s.bind((host, 0))
        s.listen()
        socks.append(s)
    except OSError:  # no IPv6 here
        pass
if sys.argv[1] == "parent":  # a grandchild of the test listens too
    subprocess.Popen([sys.executable, "-c", sys.argv[2], "leaf", ""])
print(" ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in socks), flush=True)
time.sleep(60)
"""


def test_a_tree_s_listeners_are_read_from_proc_net_and_loopback_is_told_apart() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LISTENING, "parent", LISTENING],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        bound = set(proc.stdout.readline().split())
        deadline = time.monotonic() + 20
        while len(processes.tree(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = processes.tree(proc.pid)
        assert tree[0] == proc.pid and len(tree) == 2
        while (len(processes.listeners(tree[1:])) < len(bound)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        mine = processes.listeners([proc.pid])
        assert {f"{x.address}:{x.port}" for x in mine} == bound
        assert {x.address: x.loopback for x in mine} == {
            a: a in ("127.0.0.1", "::1") for a in {b.rsplit(":", 1)[0] for b in bound}}
        assert len(processes.listeners(tree)) == 2 * len(bound)  # the grandchild's too
        beyond = next(x for x in mine if not x.loopback)
        assert str(beyond).startswith(("0.0.0.0:", "[::]:")) and f"pid {proc.pid}:" in str(beyond)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_proc_net_addresses_are_decoded_in_this_machine_s_byte_order() -> None:
    assert processes._address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert processes._address("00000000000000000000000001000000:0050") == ("::1", 80)
    mapped = processes._address("0000000000000000FFFF00000100007F:0016")
    assert mapped == ("::ffff:7f00:1", 22)
    assert processes.Listener(1, mapped[0], 22).loopback  # ::ffff:127.0.0.1
    assert not processes.Listener(1, "::", 22).loopback
    assert not processes.Listener(1, "192.0.2.2", 22).loopback
