"""`compress run --nproc N`: the same command under torchrun (one process per rank)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable

from compress.errors import UserError
from compress.system import processes

# Restarted ranks must not share the rendezvous store of the round before: there they read
# the dead rank's gloo address and fail to connect (pytorch/pytorch#135712). Every torchrun
# compress starts, or has TorchServe start, gets this.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# The torchrun of a served split model (TorchServe's `parallelType` workers, every rank on
# this machine, no --rdzv-endpoint): its agent's rendezvous in a FileStore (mkstemp'd in
# TMPDIR, the server's own folder), not a TCPStore, which listens on every interface whatever
# address it is given (pytorch/pytorch#173909). TorchServe passes no --rdzv-conf, so it goes
# by torchrun's environment. With the line above no store is shared with the ranks either:
# they meet in a FileStore of their own (serve/causal_lm/runtime/process_group.py).
LOCAL_TORCHRUN_ENV = {**TORCHRUN_ENV, "PET_RDZV_CONF": "store_type=file"}


def torchrun(args: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
             master_addr: str | None = None, master_port: int = 29500,
             echo: Callable[[str], None] = print, max_restarts: int = 0,
             oversubscribe: bool = False) -> int:
    """Run `compress run ARGS` on `nproc` local processes (x `nnodes` machines) through
    torchrun; return its exit code. A dead rank stops every rank; torchrun's elastic agent
    then starts them all again, up to `max_restarts` times, and the run resumes (finished
    stages from the cache, a training stage from its last checkpoint)."""
    if nnodes > 1 and not master_addr:
        raise UserError("--nnodes > 1 needs --master-addr (the address of node 0) and the "
                        "same --master-port on every node")
    if node_rank >= nnodes:
        raise UserError(f"--node-rank {node_rank}: must be below --nnodes {nnodes}")
    devices = _devices()
    if nproc > devices[0] and not oversubscribe:
        raise UserError(f"--nproc {nproc} is more than the {devices[0]} {devices[1]} of this "
                        f"machine: processes would share them and each run slower; use "
                        f"--nproc {devices[0]} or fewer, or add --oversubscribe to run anyway")
    if nproc > devices[0]:
        echo(f"warning: --nproc {nproc} is more than the {devices[0]} {devices[1]} of this "
             f"machine; processes will share them and run slower")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--max-restarts", str(max_restarts)]
    if nnodes == 1:
        command.append("--standalone")
    else:
        command += rendezvous_args(nnodes, node_rank, master_addr, master_port)
    command += ["-m", "compress", "run", *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env = {**TORCHRUN_ENV, **env}
    echo(f"launching {nproc * nnodes} processes with torchrun ({nproc} on this machine, "
         f"{env['OMP_NUM_THREADS']} thread(s) each)")
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    try:
        failures = _relay(process.stderr, sys.stderr)
        code = process.wait()
    except KeyboardInterrupt:
        process.wait()
        return 130
    if code and failures:
        echo("error: the job stopped: " + "; ".join(failures) + ". The run folder is "
             "consistent: re-run the same command to resume (training from its last "
             "checkpoint)")
    return code


def rendezvous_args(nnodes: int, node_rank: int, master_addr: str, master_port: int
                    ) -> list[str]:
    """torchrun's c10d rendezvous at node 0's address and port, whose store node 0 hosts:
    an agent that dies (a node killed) and is started again rejoins it, and every agent
    then starts its ranks again together (`--max-restarts`). The rendezvous, not the node
    rank, orders the global ranks, so rank 0 (the run folder's writer) may live on any
    node: the run folder must be on storage every node sees."""
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", "compress",
            "--rdzv-conf", f"is_host={str(node_rank == 0).lower()}"]


_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
_AGENT_ERROR = re.compile(r"^E\d{4} .*elastic/(multiprocessing|agent)/")
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _relay(source, sink) -> list[str]:
    """Copy the job's stderr as it comes (progress bars included, and the ranks' output
    after a restart) but hold back torchrun's own error lines and its final failure report;
    return the failures they name, in short."""
    failures: list[str] = []
    held = b""
    swallowing = False  # inside torchrun's final report, which runs to the end
    rank = None
    while chunk := os.read(source.fileno(), 65536):
        held += chunk
        while True:
            cut = max(held.rfind(b"\n"), held.rfind(b"\r"))
            if cut < 0:
                break
            lines, held = held[:cut + 1], held[cut + 1:]
            for line in lines.splitlines(keepends=True):
                text = line.decode(errors="replace")
                swallowing = swallowing or bool(_TRACEBACK.match(text))
                if _AGENT_ERROR.match(text):
                    failed = _WORKER_FAILED.search(text)
                    if failed:
                        failures.append(f"rank {failed.group(2)} exited with {failed.group(1)}")
                    continue
                if not swallowing:
                    sink.buffer.write(line)
                    continue
                field = text.strip().split(":", 1)
                if field[0].strip() == "rank":
                    rank = field[1].split("(")[0].strip()
                elif field[0].strip() == "exitcode" and rank is not None:
                    failures.append(f"rank {rank} exited with {field[1].strip()}")
                    rank = None
            sink.flush()
    if held and not swallowing:
        sink.buffer.write(held)
        sink.flush()
    unique = list(dict.fromkeys(failures))  # the report's fuller lines over the short ones
    return [f for f in unique if not any(g != f and g.startswith(f) for g in unique)]


def _devices() -> tuple[int, str]:
    """(how many, what): CUDA GPUs when there are any, else CPU cores."""
    from compress.recipe.registry import cuda_device_present

    if cuda_device_present():
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPUs"
    return os.cpu_count() or 1, "CPU cores"


def kill_rank(marker: str, rank: int) -> int:
    """SIGKILL the torchrun workers of `rank` whose command line holds `marker` (a recipe
    or run path); how many were killed (for fault-injection tests and benchmarks)."""
    killed = 0
    for pid in processes.pids():
        if marker in processes.command_line(pid) and (
                f"RANK={rank}".encode() in processes.environment(pid)):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed
