"""Two "nodes" on this machine: two `compress run --nnodes 2 --node-rank 0|1 --nproc 1`
launches that meet at torchrun's c10d rendezvous on loopback, as two hosts would, sharing one
run folder (as hosts share one over NFS). Under DDP and FSDP they end with the weights of
`--nproc 2` on one node at the same global batch, and a node killed outright (launcher,
torchrun agent and rank) and launched again rejoins: the surviving node restarts its rank
under `--max-restarts` and the run resumes from its last checkpoint to the same weights.

Every process runs on one thread, so all runs sum in the same order and the weights can be
compared bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import digits_recipe, run_cli, write_recipe

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(recipe: Path, rank: int, port: int, *args: str,
          env: dict | None = None) -> subprocess.Popen:
    """`compress run` as node `rank` of 2, in its own session (so it can die whole)."""
    command = [sys.executable, "-m", "compress", "run", str(recipe), "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
               "--master-port", str(port), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ONE_THREAD, **(env or {})},
                            start_new_session=True)


def _finish(*nodes: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    done = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            _kill_tree(node.pid)
            out, err = node.communicate()
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torchrun starts its ranks in sessions of
    their own): a machine that dies."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*"):
            with contextlib.suppress(OSError):
                tree += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    for process in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)


def _two_nodes(recipe: Path, *args: str, env: dict | None = None
               ) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    nodes = [_node(recipe, rank, port, *args, env=env) for rank in (0, 1)]
    return _finish(*nodes)


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"][0]["metrics"]


def _check(done: list[subprocess.CompletedProcess]) -> None:
    for node in done:
        assert node.returncode == 0, node.stderr[-3000:]
    assert sum(node.stdout.count("run folder:") for node in done) == 1  # rank 0 only


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, str]:
    """A small CNN on digits long enough to be killed after its first checkpoint, and the
    digest of its weights after `--nproc 2` on one node."""
    tmp = tmp_path_factory.mktemp("digits")
    raw = digits_recipe(tmp / "runs", epochs=10, batch_size=16, checkpoint_every=60,
                        learning_rate=0.003)
    raw["model"] = {"source": "compress.models.zoo:small_cnn",
                    "kwargs": {"num_classes": 10, "channels": 8}}
    recipe = write_recipe(tmp / "r.yaml", raw)
    one = run_cli("run", str(recipe), "--nproc", "2", "--output-dir", str(tmp / "one"),
                  env=ONE_THREAD)
    assert one.returncode == 0, one.stderr[-3000:]
    m = _metrics(tmp / "one/tiny_digits")
    assert m["train_processes"] == 2 and m["resumed_from_step"] == 0
    return recipe, m["param_digest"]


def test_ddp_on_two_nodes_ends_with_the_weights_of_two_processes_on_one(
        tmp_path: Path, digits: tuple[Path, str]) -> None:
    recipe, single_node = digits
    _check(_two_nodes(recipe, "--output-dir", str(tmp_path)))
    m = _metrics(tmp_path / "tiny_digits")
    print(f"DDP digests: two nodes {m['param_digest']}, one node {single_node}")
    assert m["train_processes"] == 2 and m["replicas_identical"] is True
    assert m["param_digest"] == single_node, (m["param_digest"], single_node)
    assert m["train_comm_mb_per_step"] > 0 and 0 < m["train_comm_share"] < 1
    assert m["train_comm_all_reduce_s_total"] == m["train_comm_s_total"] > 0


def test_a_killed_node_launched_again_resumes_under_max_restarts(
        tmp_path: Path, digits: tuple[Path, str]) -> None:
    recipe, single_node = digits
    args = ("--output-dir", str(tmp_path), "--max-restarts", "1")
    port = _free_port()
    survivor, doomed = (_node(recipe, rank, port, *args) for rank in (0, 1))
    checkpoint = tmp_path / "tiny_digits/00-finetune/checkpoints/checkpoint.pt"
    deadline = time.monotonic() + 180
    while not checkpoint.is_file():
        assert survivor.poll() is None and doomed.poll() is None, "a node ended early"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    _kill_tree(doomed.pid)
    killed = _finish(doomed)[0]
    assert killed.returncode == -signal.SIGKILL
    done = _finish(survivor, _node(recipe, 1, port, *args))
    _check(done)
    stderr = "".join(node.stderr for node in done)
    assert "another rank stopped during data-parallel training" in stderr
    assert "resuming from" in stderr
    m = _metrics(tmp_path / "tiny_digits")
    assert m["resumed_from_step"] >= 60 and m["resumed_from_step"] % 60 == 0
    print(f"DDP digests: node killed at step {m['resumed_from_step']} {m['param_digest']}, "
          f"one node {single_node}")
    assert m["replicas_identical"] is True
    assert m["param_digest"] == single_node, (m["param_digest"], single_node)


def test_fsdp_on_two_nodes_ends_with_the_weights_of_two_processes_on_one(
        tmp_path: Path, tiny_llama_folder: Path, data_dir: Path) -> None:
    finetune = {"kind": "finetune", "parallel": "fsdp", "max_steps": 6, "batch_size": 4,
                "learning_rate": 0.001, "checkpoint_every": 3}
    raw = {"name": "tiny_fsdp", "model": {"source": str(tiny_llama_folder)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "train": {"split": "train", "max_samples": 200},
                    "eval": {"split": "validation", "max_samples": 8}},
           "evaluation": {"generation": {"prompts": 1, "max_new_tokens": 2,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [finetune], "output_dir": str(tmp_path / "runs"), "seed": 0}
    recipe = write_recipe(tmp_path / "fsdp.yaml", raw)
    data = {"COMPRESS_DATA_DIR": str(data_dir)}
    _check(_two_nodes(recipe, "--output-dir", str(tmp_path / "two"), env=data))
    one = run_cli("run", str(recipe), "--nproc", "2", "--output-dir", str(tmp_path / "one"),
                  env={**ONE_THREAD, **data})
    assert one.returncode == 0, one.stderr[-3000:]
    two_nodes, one_node = _metrics(tmp_path / "two/tiny_fsdp"), _metrics(tmp_path / "one/tiny_fsdp")
    print(f"FSDP digests: two nodes {two_nodes['param_digest']}, "
          f"one node {one_node['param_digest']}")
    assert two_nodes["train_processes"] == 2 and two_nodes["replicas_identical"] is True
    assert two_nodes["param_digest"] == one_node["param_digest"], (two_nodes, one_node)
    for m in (two_nodes, one_node):  # parameters gathered, gradients reduce-scattered
        assert m["train_comm_all_gather_s_total"] > 0 < m["train_comm_reduce_scatter_s_total"]
        assert 0 < m["train_comm_share"] < 1 and m["train_comm_mb_per_step"] > 0
    assert two_nodes["train_comm_mb_per_step"] == one_node["train_comm_mb_per_step"]
