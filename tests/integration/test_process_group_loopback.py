"""The process group of a served split model, under torchrun as TorchServe starts it (c10d
rendezvous, no endpoint, `compress serve`'s environment): the agent's rendezvous and the
ranks' store are files in the server's own folders, gloo binds loopback, so nothing of the
job listens beyond 127.0.0.1 / ::1; rank 0's generation call and sampling seeds reach the
other rank as tensors (a pickle broadcast would fail the job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compress.distributed.launch import LOCAL_TORCHRUN_ENV
from compress.system import processes

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores"),
              pytest.mark.skipif(not processes.PROC.is_dir(), reason="needs Linux's /proc")]

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from compress.system import processes
from serve.causal_lm.runtime import leader_call, process_group, tensor_parallel
from serve.causal_lm.runtime.decode import Sampling

def no_pickles(*args, **kwargs):
    raise AssertionError("broadcast_object_list: a pickle between ranks")

dist.broadcast_object_list = no_pickles
folder = Path(sys.argv[1])
process_group.join(folder)
rank = dist.get_rank()
call = leader_call.LeaderCall([[1, 2], [3]], [4, 5], {7},
                              [None, Sampling(0.5, 0.9, 2**64 - 1)], 2)
got = leader_call.broadcast(call if rank == 0 else None)
seeds = tensor_parallel.shared_seeds([None, 2**63 + 5] if rank == 0 else [1, 2])
dist.barrier()
found = {}
if rank == 0:  # the agent (every rank's parent) and its ranks, all joined
    agent = os.getppid()
    found = {"agent": agent, "tree": processes.tree(agent),
             "listeners": [[x.pid, x.address, x.port, x.loopback]
                           for x in processes.listeners(processes.tree(agent))],
             "stores": sorted(p.name for p in folder.iterdir()),
             "temp": sorted(p.name for p in Path(os.environ["TMPDIR"]).iterdir()
                            if p.is_file())}
dist.barrier()
(folder / f"rank{rank}.json").write_text(json.dumps(
    {"same": got == call, "seeds": seeds, "backend": dist.get_backend(), **found}))
dist.destroy_process_group()
"""


def test_a_torchserve_like_torchrun_job_listens_on_loopback_alone(tmp_path: Path) -> None:
    script, folder, temp = tmp_path / "rank.py", tmp_path / "model", tmp_path / "temp"
    script.write_text(RANK)
    folder.mkdir()
    temp.mkdir()
    env = {**os.environ, **LOCAL_TORCHRUN_ENV, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("GLOO_SOCKET_IFNAME", None)
    # TorchServe's own command line (WorkerLifeCycle.attachRunner), with no torchrun: section
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-id",
                           "tiny_9000", "--max-restarts", "0", str(script), str(folder)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["same"] and second["same"] and first["backend"] == "gloo"
    assert first["seeds"] == second["seeds"]
    assert first["seeds"][1] == 2**63 + 5 and first["seeds"][0] is not None
    listeners = first["listeners"]
    assert [x for x in listeners if not x[3]] == []  # loopback alone
    ranks = set(first["tree"]) - {first["agent"]}
    assert len(ranks) == 2 and {x[0] for x in listeners} == ranks  # gloo's; the agent none
    assert [name for name in first["stores"] if name.startswith(".process-group-tiny_9000-")]
    assert [name for name in first["temp"] if name.startswith("tmp")]  # the agent's
    # rendezvous: a FileStore mkstemp'd in TMPDIR
