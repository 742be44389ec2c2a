"""A Ray node on this machine, every listener on 127.0.0.1: `ray start --block` in the
foreground of a process we own, so that stopping it (SIGTERM: Ray's own shutdown of the
node's processes, then SIGKILL of its process group) stops this node and nothing else.
`ray stop` is never used: it stops every Ray node of the machine.

The head of the local cluster `compress serve --engine ray` starts, and the nodes tests
add to it (`start_node(address=...)`), each with its own ports, a short temporary folder
(Ray's Unix sockets live under it, and AF_UNIX paths hold 107 bytes), a small object store
and no dashboard. A head's Ray Serve proxy gets compress's middleware for lost replicas
(`PROXY_HOOK`, unless the environment names a callback of its own)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compress.serving.serve_folder import free_ports
from compress.system import processes

LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Serve passes requests, not tensors, through it
TEMP_PREFIX = "cr-"
PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
              "--metrics-export-port")
HEAD_PORT_FLAGS = ("--port", "--ray-client-server-port")
# Ray Serve's proxy runs on the head: there it answers for replicas that were lost
PROXY_HOOK = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH":
              "compress.serving.ray.routes:proxy_middlewares"}


@dataclass
class Node:
    """A started node: the `ray start --block` process (its process group's leader unless
    `own_group` is False), its GCS address, its temporary folder, and the port where it
    exposes its processes' metrics in Prometheus format (Ray Serve's per-replica request
    counts and latencies among them)."""

    pid: int
    address: str
    temp_dir: str
    log: str
    metrics_port: int | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)


def ray_command() -> str:
    """The `ray` executable beside this Python."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else (shutil.which("ray") or "ray")


def start_node(log: Path, *, address: str | None = None, num_cpus: float | None = None,
               resources: dict[str, float] | None = None, own_group: bool = True,
               env: dict[str, str] | None = None, timeout_s: float = 120) -> Node:
    """Start a head node (`address` None) or a node joining the cluster at `address`;
    return once it runs (the head: once its GCS answers)."""
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    flags = PORT_FLAGS + (HEAD_PORT_FLAGS if address is None else ())
    ports = free_ports(len(flags))
    command = [ray_command(), "start", "--block", "--node-ip-address", LOOPBACK,
               "--temp-dir", temp, "--object-store-memory", str(OBJECT_STORE_BYTES),
               "--disable-usage-stats", "--log-style", "record", "--log-color", "false"]
    command += ["--head", "--include-dashboard", "false"] if address is None else [
        "--address", address]
    for flag, port in zip(flags, ports, strict=True):
        command += [flag, str(port)]
    if num_cpus is not None:
        command += ["--num-cpus", str(int(num_cpus))]
    if resources:
        command += ["--resources", json.dumps(resources)]
    gcs = address or f"{LOOPBACK}:{ports[flags.index('--port')]}"
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=own_group,
                                   env={**(PROXY_HOOK if address is None else {}),
                                        **os.environ, **(env or {}),
                                        "RAY_USAGE_STATS_ENABLED": "0"})
    node = Node(process.pid, gcs, temp, str(log), ports[flags.index("--metrics-export-port")])
    try:
        _wait_running(node, timeout_s)
    except BaseException:
        stop_node(node.record())
        raise
    return node


def _wait_running(node: Node, timeout_s: float) -> None:
    """Wait until `ray start` says the node runs (its log's "--block" notice)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not processes.alive(node.pid):
            raise RuntimeError(f"ray start exited: {_tail(node.log)}")
        if "block forever" in Path(node.log).read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray node did not start within {timeout_s:.0f} s: {_tail(node.log)}")


def stop_node(record: dict[str, Any], grace_s: float = 20) -> None:
    """Stop a node `start_node` started: SIGTERM (Ray shuts its processes down), then
    SIGKILL to what is left of its processes (those whose command line names its
    temporary folder, and its process group if it has its own); remove the folder."""
    pid, temp = int(record["pid"]), record["temp_dir"]
    own_group = _leads_group(pid)
    if processes.alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while processes.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    leftovers = set(processes.group_members(pid)) if own_group else set()
    leftovers |= node_processes(temp)
    for other in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(other, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(processes.alive(p) for p in leftovers) and time.monotonic() < deadline:
        time.sleep(0.05)
    if Path(temp).name.startswith(TEMP_PREFIX):
        shutil.rmtree(temp, ignore_errors=True)


def node_processes(temp_dir: str) -> set[int]:
    """The live processes whose command line names the node's temporary folder (its GCS,
    raylet, agents and workers all get its session folder under it)."""
    return {pid for pid in processes.pids()
            if temp_dir in processes.command_line(pid) and processes.alive(pid)}


def _leads_group(pid: int) -> bool:
    stat = processes.stat(pid)
    return stat is not None and stat.pgid == pid


def _tail(log: str, lines: int = 3) -> str:
    text = Path(log).read_text(errors="replace").splitlines() if Path(log).is_file() else []
    return " | ".join(line.strip() for line in text[-lines:]) or "no output"
