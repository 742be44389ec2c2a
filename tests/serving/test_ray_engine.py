"""`compress serve --engine ray` on two Ray nodes over loopback (a head and a worker node,
each offering one `replica_slot` and one `lm_slot`, standing in for two machines): the tiny
packaged classifier's two replicas are placed one a node (Ray's state API says so), 400
concurrent requests all get a 200 with TorchServe's label for the same text, and both
replicas, on both nodes, answer some. Without ray, or with options that contradict each
other, one line; `--stop` removes the application it deployed (and the local cluster only
when it started one), and nothing else. Last, the tiny causal LM's archive (continuous
batching) as two replicas, one a node: chats streamed through the official `openai` client
are the offline greedy text, from both replicas."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import test_causal_lm_serving
from conftest import NEGATIVE, POSITIVE, cli, http_post
from test_causal_lm_serving import PROMPTS, offline_text

from compress.serving import server
from compress.serving.ray import cluster
from compress.serving.ray.options import RayOptions
from compress.system import processes

pytestmark = pytest.mark.serving
SLOT, LM_SLOT = "replica_slot", "lm_slot"  # one of each a node: one replica of each a node
REPLICA_CLASS = "ServeReplica:compress-tiny_onnx:"  # Ray Serve names a replica APP:DEPLOYMENT
LM_REPLICA_CLASS = "ServeReplica:compress-tiny_lm:"
# the tiny causal LM's archive (batches of 8 rows) and its exported folder, as that module's
causal_lm_run = test_causal_lm_serving.causal_lm_run
offline = test_causal_lm_serving.offline
REQUESTS, CONCURRENCY = 400, 32
TEXTS = [f"a {word} film, {adverb} {word}" for word in POSITIVE + NEGATIVE
         for adverb in ("truly", "rather", "so")]
# Ray's state API without its dashboard: the GCS's actor table, read by a driver
PLACEMENT = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
actors = [{"class": a["ActorClassName"], "state": a["State"], "node": a["Address"]["NodeID"]}
          for a in ray._private.state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


@pytest.fixture(scope="module")
def engine() -> str:
    return "ray"  # the collection hook skips this module's tests where ray is missing


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, engine: str):
    """A head and a worker node on 127.0.0.1, one CPU and one slot of each kind each."""
    slots = {SLOT: 1, LM_SLOT: 1}
    yield from head_and_worker(tmp_path_factory.mktemp("ray_nodes"), slots, slots)


def head_and_worker(logs: Path, head_resources: dict[str, float],
                    worker_resources: dict[str, float], env: dict[str, str] | None = None):
    """A fixture's body: a head and a worker node on 127.0.0.1 (one CPU each, their custom
    resources), yielded as (head, worker); then both stopped, and nothing of theirs left."""
    head = cluster.start_node(logs / "head.log", num_cpus=1, resources=head_resources,
                              env=env)
    try:
        worker = cluster.start_node(logs / "worker.log", address=head.address, num_cpus=1,
                                    resources=worker_resources, env=env)
    except BaseException:
        cluster.stop_node(head.record())
        raise
    yield head, worker
    for node in (worker, head):
        cluster.stop_node(node.record())
        assert not processes.alive(node.pid)
        assert not cluster.node_processes(node.temp_dir)


def _copy(mar: Path, folder: Path) -> Path:
    """The archive in a folder of its own (each server keeps its files beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(mar, folder / mar.name))


@pytest.fixture(scope="module")
def archive(packaged_text_run: Path) -> Path:
    return packaged_text_run / "03-package/tiny_onnx.mar"


@pytest.fixture(scope="module")
def reference(archive: Path, tmp_path_factory, state_dir) -> dict[str, str]:
    """Each text's label from TorchServe serving the same archive."""
    if shutil.which("java") is None:
        pytest.skip("the reference answers are TorchServe's, which needs Java 17")
    target = server.resolve_target(_copy(archive, tmp_path_factory.mktemp("torchserve")))
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=180, echo=lambda _: None,
                        engine="torchserve")
    try:
        labels = {}
        for text in TEXTS:
            status, _, answer = http_post(info["url"], json.dumps({"text": text}).encode(),
                                          info["token"])
            assert status == 200, answer
            labels[text] = answer["label"]
    finally:
        server.stop(target.serve_dir)
    assert set(labels.values()) == {"positive", "negative"}
    return labels


@pytest.fixture(scope="module")
def served(two_nodes, archive: Path, tmp_path_factory, state_dir) -> dict:
    """The archive as 2 replicas on the two-node cluster, one replica slot each."""
    head, _ = two_nodes
    target = server.resolve_target(_copy(archive, tmp_path_factory.mktemp("ray")))
    (port,) = server.free_ports(1)
    options = RayOptions(replicas=2, cpus_per_replica=0.5, replica_resources={SLOT: 1},
                         address=head.address)
    started = time.monotonic()
    info = server.start(target, port=port, timeout_s=240, echo=lambda _: None,
                        engine="ray", ray=options)
    print(f"2 replicas on 2 nodes up in {time.monotonic() - started:.1f} s")
    yield info
    server.stop(target.serve_dir)
    assert not processes.alive(info["pid"])


def _placement(address: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PLACEMENT, address], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_two_replicas_are_placed_one_on_each_node(served: dict, two_nodes) -> None:
    head, _ = two_nodes
    placement = _placement(head.address)
    replicas = [a for a in placement["actors"]
                if a["state"] == "ALIVE" and a["class"].startswith(REPLICA_CLASS)]
    assert len(placement["nodes"]) == 2
    assert len(replicas) == 2, placement["actors"]
    assert {a["node"] for a in replicas} == set(placement["nodes"])


def test_400_concurrent_requests_get_torchserves_labels_from_both_nodes(
        served: dict, reference: dict[str, str], two_nodes) -> None:
    texts = [TEXTS[i % len(TEXTS)] for i in range(REQUESTS)]

    def ask(text: str):
        status, headers, answer = http_post(served["url"], json.dumps({"text": text}).encode(),
                                            served["token"])
        return text, status, headers.get("X-Compress-Replica"), headers.get(
            "X-Compress-Node"), answer

    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(ask, texts))
    seconds = time.monotonic() - started
    print(f"{REQUESTS} requests at c{CONCURRENCY} in {seconds:.1f} s "
          f"({REQUESTS / seconds:.0f} req/s)")
    assert [status for _, status, *_ in answers] == [200] * REQUESTS, [
        a for a in answers if a[1] != 200][:3]
    wrong = [(text, answer) for text, _, _, _, answer in answers
             if answer["label"] != reference[text]]
    assert not wrong, wrong[:5]
    by_replica: dict[str, int] = {}
    for _, _, replica, _, _ in answers:
        by_replica[replica] = by_replica.get(replica, 0) + 1
    nodes = {node for _, _, _, node, _ in answers}
    print("answers by replica:", by_replica)
    assert len(by_replica) == 2 and None not in by_replica, by_replica
    assert nodes == set(_placement(two_nodes[0].address)["nodes"])


def test_auth_limits_and_unknown_routes_answer_as_torchserve(served: dict) -> None:
    body = json.dumps({"text": TEXTS[0]}).encode()
    status, headers, answer = http_post(served["url"], body, "not-the-token")
    assert status == 401 and answer["type"] == "InvalidKeyException"
    assert headers.get("X-Compress-Replica")
    status, _, answer = http_post(served["url"] + "/9.9", body, served["token"])
    assert status == 404 and answer["code"] == 404
    status, _, answer = http_post(served["url"].replace("tiny_onnx", "other"), body,
                                  served["token"])
    assert status == 404
    status, answer = _post_early_answered(served, b"x" * 6_553_501)
    assert status == 413 and answer["type"] == "RequestTooLargeException"
    status, _, answer = http_post(served["url"], b"{not json", served["token"])
    assert status == 400
    port = served["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10) as ping:
        assert ping.status == 200 and json.loads(ping.read()) == {"status": "Healthy"}


def _post_early_answered(served: dict, body: bytes) -> tuple[int, dict]:
    """(status, JSON answer) of a POST the server may answer before it has read the body
    (and then close: the rest of the body meets a closed socket)."""
    parts = urlsplit(served["url"])
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.putrequest("POST", parts.path)
    for name, value in (("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))),
                        ("Authorization", f"Bearer {served['token']}")):
        connection.putheader(name, value)
    connection.endheaders()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        connection.send(body)
    answer = connection.getresponse()
    try:
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_without_ray_serve_is_one_line_naming_the_extra(archive: Path, monkeypatch, capsys,
                                                        tmp_path: Path) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else found(name, *a))
    code, out, err = cli(monkeypatch, capsys, "serve", str(_copy(archive, tmp_path)),
                         "--engine", "ray")
    assert code == 2 and err.count("\n") == 1, err
    assert "pip install -e '.[ray]'" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "litserve", "--replicas", "2"], "--replicas: options of --engine ray"),
    (["--address", "127.0.0.1:1"], "--address: options of --engine ray"),
    (["--engine", "ray", "--replicas", "2", "--autoscale", "1,2"], "contradict"),
    (["--engine", "ray", "--autoscale", "3,1"], "MIN <= MAX"),
    (["--engine", "ray", "--autoscale", "two"], "expected MIN,MAX"),
    (["--engine", "ray", "--downscale-delay", "5"], "give both"),
    (["--engine", "ray", "--replica-resources", "[1]"], "JSON object"),
    (["--engine", "ray", "--workers", "2"], "use --replicas"),
])
def test_bad_options_are_one_line(args: list[str], message: str, archive: Path, monkeypatch,
                                  capsys, tmp_path: Path) -> None:
    code, _, err = cli(monkeypatch, capsys, "serve", str(_copy(archive, tmp_path)), *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_stop_removes_its_own_application_and_cluster_and_nothing_else(
        served: dict, two_nodes, archive: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """A second archive served on a local cluster compress starts: `--stop` of it stops that
    cluster; `--stop` of the one on the two nodes removes its application, and the two
    nodes run on."""
    head, worker = two_nodes
    mar = _copy(archive, tmp_path / "local")
    (port,) = server.free_ports(1)
    code, out, err = cli(monkeypatch, capsys, "serve", str(mar), "--engine", "ray",
                         "--port", str(port), "--timeout", "240")
    assert code == 0, err
    assert "on a local Ray cluster" in out, out
    local = server.read_info(mar.with_suffix(".serve"))
    status, headers, _ = http_post(local["url"], json.dumps({"text": TEXTS[0]}).encode(),
                                   local["token"])
    assert status == 200 and headers.get("X-Compress-Node")
    # the local cluster's metrics in Prometheus format (a joined cluster's are its own)
    with urllib.request.urlopen(local["metrics_url"], timeout=30) as metrics:
        assert metrics.status == 200 and b"\nray_" in metrics.read()
    state = json.loads((mar.with_suffix(".serve") / "ray-state.json").read_text())
    local_temp = state["cluster"]["temp_dir"]
    assert cluster.node_processes(local_temp)
    code, out, err = cli(monkeypatch, capsys, "serve", "--stop", str(mar))
    assert code == 0 and "stopped 1 server(s)" in out, (out, err)
    assert not processes.alive(local["pid"]) and not cluster.node_processes(local_temp)
    # the two-node cluster's application answers yet; its own --stop removes it alone
    status, _, _ = http_post(served["url"], json.dumps({"text": TEXTS[0]}).encode(),
                             served["token"])
    assert status == 200
    serve_dir = Path(served["serve_dir"])
    assert server.stop(serve_dir)
    placement = _placement(head.address)
    assert len(placement["nodes"]) == 2
    assert not [a for a in placement["actors"]
                if a["state"] == "ALIVE" and a["class"].startswith(REPLICA_CLASS)]
    assert processes.alive(head.pid) and processes.alive(worker.pid)


@pytest.fixture(scope="module")
def served_lm(two_nodes, causal_lm_run: Path, state_dir) -> dict:
    """The tiny causal LM's archive as 2 replicas on the two nodes, one `lm_slot` each.
    Used by the module's last test: a Serve cluster holds one compress archive (route
    prefix /), and `test_stop_removes_...` has removed the classifier's by then."""
    target = server.resolve_target(causal_lm_run)
    (port,) = server.free_ports(1)
    options = RayOptions(replicas=2, cpus_per_replica=0.5, replica_resources={LM_SLOT: 1},
                         address=two_nodes[0].address)
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None,
                        engine="ray", ray=options)
    yield info
    server.stop(target.serve_dir)
    assert not processes.alive(info["pid"])


def test_the_openai_clients_streamed_chats_are_the_offline_text_from_both_nodes(
        served_lm: dict, offline, two_nodes) -> None:
    """40 chats at once (each prompt 5 times, released together), streamed through the
    official client: each is the offline greedy text; the LM's replicas sit one a node and
    both answered. A replica holds 16 at most (two batches of its 8 rows) and Ray's proxy
    fills the replica of its own node first: the tiny model's chats are short, so more than
    16 must be in flight at once for the second replica to get some (32 of 24 tokens gave
    it 1 on a loaded machine)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served_lm['url']}/1.0/v1",
                           api_key=served_lm.get("token") or "unused", max_retries=0)

    together = threading.Barrier(40)

    def chat(prompt: str) -> tuple[str, str, str | None]:
        together.wait()
        raw = client.chat.completions.with_raw_response.create(
            model="tiny_lm", messages=[{"role": "user", "content": prompt}], max_tokens=96,
            temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse()
                       if chunk.choices)
        return prompt, text, raw.headers.get("X-Compress-Replica")

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(chat, PROMPTS * 5))
    want = {prompt: offline_text(offline, prompt, 96) for prompt in PROMPTS}
    wrong = [(prompt, text, want[prompt]) for prompt, text, _ in answers
             if text != want[prompt]]
    assert not wrong, wrong[:3]
    placement = _placement(two_nodes[0].address)
    replicas = [a for a in placement["actors"]
                if a["state"] == "ALIVE" and a["class"].startswith(LM_REPLICA_CLASS)]
    assert {a["node"] for a in replicas} == set(placement["nodes"]) and len(replicas) == 2
    by_replica: dict[str | None, int] = {}
    for *_, replica in answers:
        by_replica[replica] = by_replica.get(replica, 0) + 1
    print("LM chats by replica:", by_replica)
    assert len(by_replica) == 2 and None not in by_replica, by_replica
