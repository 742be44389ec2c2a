"""Two TorchServe servers started at the same moment on one machine (issue 70, item 3): each
worker's Unix socket lies in its own server's temporary folder, none in the shared /tmp
(where TorchServe 0.12 names every server's first worker `/tmp/.ts.sock.9000`: a leftover
of another user's stops a worker, and two servers starting at once can cross-connect), and
each server answers with its own model."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import http_post, unix_sockets

pytest.importorskip("ts")

from benchmarks.soak import run as soak  # noqa: E402
from compress.serving import server  # noqa: E402
from compress.system import processes  # noqa: E402

pytestmark = pytest.mark.serving


def _socket_arguments(pid: int) -> list[str]:
    """The `--sock-name` a TorchServe worker was started with (none for TCP workers)."""
    words = processes.command_line(pid).split()
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--sock-name"]


def test_two_servers_started_at_once_keep_their_worker_sockets_apart(
        packaged_text_run: Path, tmp_path: Path, state_dir) -> None:
    # tiny_onnx refuses a text over 200 characters (its archive's max_text_chars); tiny_ts
    # takes it: an answer says whose worker (whose handler) served it
    targets = []
    for name, stage in (("tiny_onnx", "03-package"), ("tiny_ts", "04-package")):
        (tmp_path / name).mkdir()
        mar = shutil.copy(packaged_text_run / stage / f"{name}.mar", tmp_path / name)
        targets.append(server.resolve_target(mar))
    ports = server.free_ports(2)
    gate = threading.Barrier(2)

    def start(index: int) -> dict:
        gate.wait()
        return server.start(targets[index], port=ports[index], timeout_s=180,
                            echo=lambda _: None, engine="torchserve")

    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(start, range(2)))
        long_text = json.dumps({"text": "lovely warm movie " * 15}).encode()  # 270 chars
        for _ in range(3):
            onnx = http_post(infos[0]["url"], long_text, infos[0]["token"])
            ts = http_post(infos[1]["url"], long_text, infos[1]["token"])
            assert onnx[0] == 400 and onnx[2]["error"] == (
                "text too long: 270 characters, at most 200"), onnx
            assert ts[0] == 200 and ts[2]["label"] == "positive", ts
        for info in infos:
            temp = Path(info["temp_dir"])
            workers = soak.worker_pids(info["pid"])
            assert workers, f"no worker of {info['model_name']}"
            named = [Path(name) for pid in workers for name in _socket_arguments(pid)]
            assert named and all(path.parent == temp for path in named), (temp, named)
            held = {Path(path) for path in unix_sockets(soak.group_pids(info["pid"]))}
            assert held and all(path.parent == temp for path in held), (temp, held)
            assert not [p for p in held if p.parent == Path("/tmp")], held
    finally:
        for target in targets:
            server.stop(target.serve_dir, echo=lambda _: None)
