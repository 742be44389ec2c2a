"""A real server on free loopback ports serving the tiny packaged BERT, TorchServe and then
LitServe (the `engine` fixture): predictions equal the exported file's offline ones,
batching happens, a bad request is answered 400 alone, tokens are enforced, and every
server is stopped with nothing left running."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import http_post, run_cli

pytest.importorskip("ts")

from compress.serving import server  # noqa: E402
from compress.serving.litserve import launch as litserve_launch  # noqa: E402
from compress.serving.torchserve import launch as torchserve_launch  # noqa: E402
from compress.system import processes  # noqa: E402
from export.folder import load_export  # noqa: E402

pytestmark = pytest.mark.serving


def _our_processes(info: dict) -> list[int]:
    """Live pids of a server: its process group (java and the Python workers it spawned)
    and anything whose command line names its serve folder."""
    group = set(processes.group_members(info["pgid"]))
    return [pid for pid in processes.pids()
            if (pid in group or info["serve_dir"] in processes.command_line(pid))
            and processes.alive(pid)]


def test_served_predictions_equal_offline_ones(served: dict, packaged_text_run: Path) -> None:
    table = packaged_text_run.parent.parent / "sentiment/validation.tsv"
    texts = [line.split("\t")[0] for line in table.read_text().splitlines()[1:]]
    assert len(texts) == 80

    def ask(text: str):
        return http_post(served["url"], json.dumps({"text": text}).encode(), served["token"])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, texts))
    assert [status for status, _, _ in answers] == [200] * 80
    offline = load_export(packaged_text_run / "01-export/onnx", threads=1)
    names = offline.label_names
    expected = []
    for start in range(0, 80, 16):
        encoded = offline.tokenizer(texts[start:start + 16], padding=True, return_tensors="pt")
        expected.append(torch.softmax(offline.model(**encoded), dim=-1))
    expected = torch.cat(expected)
    got = torch.tensor([[a["probabilities"][n] for n in names] for _, _, a in answers])
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert (got - expected).abs().max().item() <= 1e-4
    batch_sizes = [int(headers["X-Batch-Size"]) for _, headers, _ in answers]
    assert max(batch_sizes) > 1 and max(batch_sizes) <= 8


def test_one_malformed_request_among_sixteen_gets_the_only_400(served: dict) -> None:
    bodies = [json.dumps({"text": f"great lovely movie number {i}"}).encode()
              for i in range(16)]
    bodies.insert(7, b'{"text": "a broken')
    gate = threading.Barrier(len(bodies))

    def ask(body: bytes):
        gate.wait()
        return http_post(served["url"], body, served["token"])

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(ask, bodies))
    statuses = [status for status, _, _ in answers]
    assert statuses.count(400) == 1 and statuses.count(200) == 16
    assert statuses[7] == 400 and answers[7][2]["error"].startswith("malformed JSON")
    assert all(a["label"] == "positive" for s, _, a in answers if s == 200)
    assert max(int(headers["X-Batch-Size"]) for _, headers, _ in answers) > 1


def test_requests_without_the_token_are_refused(served: dict, engine: str) -> None:
    """LitServe answers 401; TorchServe 0.12 answers its InvalidKeyException with a 400."""
    refused = {"torchserve": 400, "litserve": 401}[engine]
    body = json.dumps({"text": "good"}).encode()
    for token in (None, "wrong"):
        status, _, answer = http_post(served["url"], body, token)
        assert status == refused and "Token Authorization failed" in answer["message"]
    assert http_post(served["url"], body, served["token"])[0] == 200


def test_plain_text_and_lists_of_texts(served: dict) -> None:
    status, _, answer = http_post(served["url"], b"superb brilliant movie", served["token"],
                                  content_type="text/plain")
    assert status == 200 and answer["label"] == "positive"
    status, _, answer = http_post(served["url"], json.dumps({"texts": ["good", "bad", "sad"]})
                                  .encode(), served["token"])
    assert status == 200 and [a["label"] for a in answer] == ["positive", "negative",
                                                              "negative"]
    status, _, answer = http_post(served["url"], json.dumps({"text": "y" * 500}).encode(),
                                  served["token"])
    assert status == 400 and answer["error"] == "text too long: 500 characters, at most 200"


def test_a_second_server_on_a_busy_port_fails_clearly(served: dict, packaged_text_run: Path,
                                                      engine: str) -> None:
    result = run_cli("serve", str(packaged_text_run), "--port", str(served["port"]),
                     "--engine", engine)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: port {served['port']} on 127.0.0.1 is in use (another server?): choose "
        f"another with --port, or stop what holds it")
    again = run_cli("serve", str(packaged_text_run / "03-package/tiny_onnx.mar"),
                    "--engine", engine)
    assert again.returncode == 2 and "already served at" in again.stderr
    assert http_post(served["url"], b'{"text": "good"}', served["token"])[0] == 200


def test_cli_serves_a_run_folder_and_stops_it(packaged_text_run: Path, state_dir,
                                              engine: str) -> None:
    (port,) = server.free_ports(1)
    env = {"COMPRESS_STATE_DIR": str(state_dir)}
    if engine == "litserve":  # no java to be found
        env |= {"PATH": "/nonexistent", "JAVA_HOME": ""}
    result = run_cli("serve", str(packaged_text_run), "--port", str(port), "--no-auth",
                     "--batch-size", "2", "--engine", engine, env=env)
    try:
        assert result.returncode == 0, result.stderr[-2000:]
        url = f"http://127.0.0.1:{port}/predictions/tiny_ts"  # the run's latest package
        assert f"serving tiny_ts at {url}" in result.stdout
        assert "batch size 2" in result.stdout and "try: curl -s -H" in result.stdout
        info = server.read_info(packaged_text_run / "serve")
        assert info["auth"] is False and info["settings"]["batchSize"] == 2
        assert info.get("engine", "torchserve") == engine
        if engine == "torchserve":
            config = (packaged_text_run / "serve/config.properties").read_text()
            assert "enable_model_api=false" in config
            assert all(line.split("=", 1)[1].startswith(("http://127.0.0.1:", "127.0.0.1"))
                       for line in config.splitlines() if "_address=" in line)
        status, _, answer = http_post(url, b'{"text": "lovely warm movie"}')
        assert status == 200 and answer["label"] == "positive"
        assert Path(info["temp_dir"]).is_dir()  # the workers' TMPDIR
    finally:
        stopped = run_cli("serve", "--stop", str(packaged_text_run), env=env)
    assert not Path(info["temp_dir"]).exists()
    assert stopped.returncode == 0
    assert stopped.stdout.split() == ["stopped", "1", "server(s)", str(packaged_text_run / "serve")]
    assert not processes.alive(info["pid"]) and not server.port_in_use(port)
    assert not _our_processes(info)


def test_java_missing_is_explained(packaged_text_run: Path) -> None:
    env = {"PATH": "/nonexistent", "JAVA_HOME": ""}
    result = run_cli("serve", str(packaged_text_run), "--port", "1", env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {torchserve_launch.JAVA_HELP}"


def test_litserve_missing_is_explained(packaged_text_run: Path, monkeypatch, capsys) -> None:
    import importlib.util

    from conftest import cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "litserve" else find_spec(name, *args))
    code, _, err = cli(monkeypatch, capsys, "serve", str(packaged_text_run), "--engine",
                       "litserve")
    assert code == 2 and err.strip() == f"error: {litserve_launch.INSTALL_HELP}"


def test_a_run_without_a_package_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"stages": []}))
    result = run_cli("serve", str(tmp_path))
    assert result.returncode == 2
    assert "the run has no finished package stage; add {kind: package}" in result.stderr


def test_stop_without_a_target_leaves_no_process(served: dict, state_dir: Path) -> None:
    running = _our_processes(served)
    assert served["pid"] in running and len(running) >= 2  # java and at least one worker
    stopped = run_cli("serve", "--stop", env={"COMPRESS_STATE_DIR": str(state_dir)})
    assert stopped.returncode == 0 and served["serve_dir"] in stopped.stdout
    assert not _our_processes(served) and not server.port_in_use(served["port"])
    assert not list(state_dir.glob("servers/*.json"))


BROKEN_HANDLER = '''from ts.torch_handler.base_handler import BaseHandler


class Broken(BaseHandler):
    def initialize(self, context):
        raise RuntimeError("the weights are corrupt (on purpose)")
'''


def test_serve_stops_within_a_minute_when_the_worker_cannot_start(tmp_path: Path,
                                                                  state_dir, engine) -> None:
    """A handler that raises in initialize: TorchServe would restart its worker for the
    whole timeout; `compress serve` stops at the second death with the exception (LitServe:
    at the first)."""
    import subprocess
    import sys
    import time

    (tmp_path / "broken_handler.py").write_text(BROKEN_HANDLER)
    subprocess.run([sys.executable, "-m", "model_archiver.model_packaging", "--model-name",
                    "broken", "--version", "1.0", "--handler",
                    str(tmp_path / "broken_handler.py"), "--export-path", str(tmp_path)],
                   check=True, capture_output=True)
    (port,) = server.free_ports(1)
    began = time.monotonic()
    result = run_cli("serve", str(tmp_path / "broken.mar"), "--port", str(port),
                     "--timeout", "600", "--engine", engine,
                     env={"COMPRESS_STATE_DIR": str(state_dir)})
    spent = time.monotonic() - began
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and spent < 60, (spent, result.stderr[-2000:])
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "worker died while starting" in errors[0]
    assert "RuntimeError: the weights are corrupt (on purpose)" in errors[0]
    log = tmp_path / "broken.serve" / "logs" / "model_log.log"
    assert f"(log: {log})" in errors[0] and log.is_file()
    assert not (tmp_path / "broken.serve" / server.SERVER_INFO).exists()  # stopped
    assert not server.port_in_use(port)
