"""`compress serve --engine ray` under faults (issue 77), on two Ray nodes over loopback (a
head offering two `replica_slot`s, a worker offering one, standing in for two machines):

- a replica SIGKILLed in the middle of 500 requests at concurrency 32: every request gets a
  200 or a 5xx (none hangs, none meets a closed connection), the 5xx in TorchServe's JSON;
  the survivor answers on, and Ray starts a replacement;
- the worker node stopped: its replica comes back on the head, and requests succeed;
- an LM stream whose replica is SIGKILLed ends with a framed error event, never a silent cut;
- `--autoscale 1,2 --downscale-delay 5` goes to 2 replicas under load and back to 1 after.

Requests in flight on a lost replica get a 5xx: Ray Serve does not retry them elsewhere, nor
does compress, as a retry could run a request that is not idempotent twice (a generation
whose tokens were already streamed, a request with effects). A replica's process is the one
that dies, so the 5xx and the stream's error event are written by Ray Serve's proxy on the
head, through the middleware compress hooks into it (`routes.LostReplica`, named on every
head `cluster.start_node` starts). Ray's proxy alone (2.60) records the replica's
ActorDiedError as a 500 but sends nothing: uvicorn answers a plain-text "Internal Server
Error" before the answer began; after it began, it closes the connection without the chunked
body's last chunk (seen here through http.client: its `readline` takes the cut for an end,
its `read` raises IncompleteRead).

The tests run in the file's order on one cluster, one server at a time (a Serve cluster
holds one application at route prefix /); the last stops the worker node.

The times measured are printed (`-s`), and asserted only against sane bounds: on CI's two
cores (or beside a training job) they vary tenfold."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from test_causal_lm_serving import causal_lm_run  # noqa: F401 (a fixture)
from test_ray_engine import SLOT, TEXTS, _copy, head_and_worker

from compress.serving import server
from compress.serving.ray import cluster
from compress.serving.ray.options import RayOptions
from compress.system import processes

pytestmark = pytest.mark.serving
BOUND_S = 180  # a sane upper bound for every recovery measured here
# Ray Serve's autoscaling metrics pushed each second (its default: each 10 s), on every node
FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
# a driver printing, each 0.2 s, the live nodes (their replica slots), Serve's replicas in
# the GCS's actor table (Ray's state API without its dashboard) and their Serve states
WATCH = """
import json, sys, time
import ray
from ray import serve
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
while True:
    nodes = {n["NodeID"]: n["Resources"].get(sys.argv[2], 0) for n in ray.nodes() if n["Alive"]}
    replicas = [{"name": a["Name"], "state": a["State"], "node": a["Address"]["NodeID"],
                 "pid": a["Pid"]} for a in state.actors().values()
                if a["ActorClassName"].startswith("ServeReplica:")]
    try:
        running = sum(d.replica_states.get("RUNNING", 0)
                      for app in serve.status().applications.values()
                      for d in app.deployments.values())
    except Exception:  # no Serve now; the next one is another controller
        running = 0
        serve.context._disconnect()
    print(json.dumps({"at": time.monotonic(), "nodes": nodes, "replicas": replicas,
                      "running": running}), flush=True)
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def engine() -> str:
    return "ray"  # the collection hook skips this module's tests where ray is missing


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, engine: str):
    """A head (2 replica slots: room for both replicas once the worker is gone) and a
    worker node (1 slot) on 127.0.0.1; the test that stops the worker comes last."""
    yield from head_and_worker(tmp_path_factory.mktemp("ray_nodes"), {SLOT: 2}, {SLOT: 1},
                               FAST_METRICS)


class Watch:
    """The WATCH driver's latest snapshot, read by a thread."""

    def __init__(self, address: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WATCH, address, SLOT],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
        self.latest: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.latest = json.loads(line)

    def until(self, holds: Callable[[dict], bool], timeout_s: float = BOUND_S) -> dict:
        """The first snapshot (taken after this call) for which `holds` is true."""
        called = time.monotonic()
        while time.monotonic() < called + timeout_s:
            latest = self.latest
            if latest is not None and latest["at"] > called and holds(latest):
                return latest
            time.sleep(0.05)
        raise AssertionError(f"not within {timeout_s:.0f} s: {self.latest}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def alive(snapshot: dict) -> list[dict]:
    return [r for r in snapshot["replicas"] if r["state"] == "ALIVE"]


@pytest.fixture(scope="module")
def watch(nodes):
    watcher = Watch(nodes[0].address)
    watcher.until(lambda s: len(s["nodes"]) == 2, 120)
    yield watcher
    watcher.close()


@contextlib.contextmanager
def serving(source: Path, nodes, **options) -> Iterator[dict]:
    """`source` served on the two nodes, each replica taking one replica slot."""
    head, _ = nodes
    target = server.resolve_target(source)
    (port,) = server.free_ports(1)
    started = time.monotonic()
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None, engine="ray",
                        ray=RayOptions(cpus_per_replica=0.5, replica_resources={SLOT: 1},
                                       address=head.address, **options))
    print(f"{target.model_name} up in {time.monotonic() - started:.1f} s")
    try:
        yield info
    finally:
        server.stop(target.serve_dir)
    assert not processes.alive(info["pid"])


def post(info: dict, text: str, timeout_s: float = 120) -> dict:
    """One classification request: its status (None: no HTTP answer), replica, body and
    when it was sent and answered (time.monotonic)."""
    parts = urlsplit(info["url"])
    sent = time.monotonic()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request("POST", parts.path, body=json.dumps({"text": text}).encode(),
                           headers={"Content-Type": "application/json",
                                    "Authorization": f"Bearer {info['token']}"})
        answer = connection.getresponse()
        status, body = answer.status, answer.read()
        replica, media = answer.getheader("X-Compress-Replica"), answer.getheader(
            "Content-Type")
    except (OSError, http.client.HTTPException) as error:
        status, body, replica, media = None, repr(error).encode(), None, None
    finally:
        connection.close()
    return {"status": status, "body": body, "replica": replica, "media": media,
            "sent": sent, "done": time.monotonic()}


def torchserve_error(answer: dict) -> dict:
    """A 5xx's body, which must be TorchServe's JSON error object."""
    assert (answer["media"] or "").startswith("application/json"), answer
    body = json.loads(answer["body"])
    assert set(body) == {"code", "type", "message"} and body["code"] == answer["status"], body
    return body


@pytest.fixture(scope="module")
def two_replicas(nodes, watch: Watch, packaged_text_run: Path, tmp_path_factory):
    """The tiny classifier as 2 replicas, placed one a node (Ray Serve spreads a
    deployment's replicas over the nodes that have room: checked)."""
    mar = _copy(packaged_text_run / "03-package/tiny_onnx.mar",
                tmp_path_factory.mktemp("classifier"))
    with serving(mar, nodes, replicas=2) as info:
        placed = watch.until(lambda s: len(alive(s)) == 2 and s["running"] == 2)
        assert {r["node"] for r in alive(placed)} == set(placed["nodes"]), placed
        yield info


def test_an_lm_stream_whose_replica_is_killed_ends_with_an_error_event(
        nodes, watch: Watch, causal_lm_run: Path) -> None:  # noqa: F811
    """A streamed chat completion (160 tokens asked) whose one replica is SIGKILLed after
    its first event: the stream ends with an SSE error event (`error_line`, written by the
    proxy's middleware), not a silent cut; no `[DONE]` follows it."""
    with serving(causal_lm_run, nodes, replicas=1) as info:
        (replica,) = alive(watch.until(lambda s: len(alive(s)) == 1 and s["running"] == 1))
        parts = urlsplit(info["url"])
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        connection.request("POST", parts.path + "/1.0/v1/chat/completions", body=json.dumps(
            {"model": "tiny_lm", "messages": [{"role": "user", "content": "the film was"}],
             "max_tokens": 160, "temperature": 0, "stream": True}).encode(),
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {info['token']}"})
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
        first = answer.readline()
        assert first.startswith(b"data: {"), first
        os.kill(replica["pid"], signal.SIGKILL)
        killed = time.monotonic()
        try:  # read whole: http.client's readline would hide a cut chunked body as an end
            rest, ending = answer.read(), "the chunked body's last chunk"
        except http.client.IncompleteRead as cut:
            rest, ending = cut.partial, repr(cut)
        connection.close()
        events = [e.strip() for e in (first + rest).split(b"\n\n") if e.strip()]
        print(f"after the kill: {len(events) - 1} more events in {time.monotonic() - killed:.2f}"
              f" s, then {ending}; the last: {events[-1][:200]!r}")
        assert b"data: [DONE]" not in events, "the stream ended before the kill: too short"
        last = json.loads(events[-1].removeprefix(b"data: "))
        assert set(last) == {"error"} and last["error"]["type"] == "server_error", last
        assert ending == "the chunked body's last chunk", ending


def test_autoscale_1_2_goes_to_2_replicas_under_load_and_back_to_1(
        nodes, watch: Watch, packaged_text_run: Path, tmp_path_factory) -> None:
    """`--autoscale 1,2 --downscale-delay 5` (upscale delay 2 s; metrics pushed each second,
    `FAST_METRICS`) under a load at concurrency 32: 2 replicas run; once the load stops,
    1 again."""
    mar = _copy(packaged_text_run / "03-package/tiny_onnx.mar",
                tmp_path_factory.mktemp("autoscaled"))
    with serving(mar, nodes, autoscale=(1, 2), downscale_delay_s=5) as info:
        watch.until(lambda s: s["running"] == 1 and len(alive(s)) == 1)
        stop, answers = threading.Event(), []

        def load(k: int) -> None:
            while not stop.is_set():
                answers.append(post(info, TEXTS[k % len(TEXTS)])["status"])

        began = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            for k in range(32):
                pool.submit(load, k)
            try:
                up = watch.until(lambda s: s["running"] == 2)["at"] - began
            finally:
                stop.set()
        ended = time.monotonic()
        down = watch.until(lambda s: s["running"] == 1 and len(alive(s)) == 1)["at"] - ended
        print(f"autoscale 1,2: 2 replicas running {up:.1f} s after a c32 load began "
              f"({len(answers)} requests), 1 again {down:.1f} s after it ended")
        assert set(answers) == {200}, {s: answers.count(s) for s in set(answers)}


def test_a_replica_killed_mid_load_fails_its_requests_and_is_replaced(
        two_replicas: dict, watch: Watch) -> None:
    """500 requests at concurrency 32; after the first 100 the worker node's replica is
    SIGKILLed. Each request gets a 200 or a 5xx (TorchServe's JSON): none hangs or meets a
    closed connection; requests sent after the kill succeed on the survivor, and Ray
    starts a replacement (2 replicas running again)."""
    info = two_replicas
    head_id = next(n for n, slots in watch.latest["nodes"].items() if slots == 2)
    (victim,) = [r for r in alive(watch.latest) if r["node"] != head_id]
    answers: list[dict] = []

    def ask(k: int) -> None:
        answers.append(post(info, TEXTS[k % len(TEXTS)]))

    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(ask, k) for k in range(500)]
        while len(answers) < 100:
            time.sleep(0.005)
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()
        for future in futures:
            future.result()
    replaced = watch.until(lambda s: s["running"] == 2 and len(alive(s)) == 2
                           and victim["name"] not in {r["name"] for r in alive(s)})
    statuses = {s: sum(a["status"] == s for a in answers) for s in {a["status"] for a in answers}}
    failed = [a for a in answers if a["status"] != 200]
    after = [a for a in answers if a["sent"] > killed]
    first_ok = min((a["done"] for a in after if a["status"] == 200), default=None)
    last_failed = max((a["done"] for a in failed), default=killed)
    print(f"killed replica {victim['name']} after 100 of 500 requests: statuses {statuses}; "
          f"5xx: {len(failed)}, the last {last_failed - killed:.2f} s after the kill; "
          f"a request sent after the kill succeeded {first_ok - killed:.2f} s after it; "
          f"2 replicas running again {replaced['at'] - killed:.1f} s after it; "
          f"5xx bodies: {sorted({a['body'][:120] for a in failed})[:3]}")
    assert all(a["status"] == 200 or (a["status"] or 0) >= 500 for a in answers), [
        a for a in failed if not (a["status"] or 0) >= 500][:3]
    for answer in failed:
        assert "lost" in torchserve_error(answer)["message"], answer
    assert first_ok is not None and first_ok - killed < BOUND_S
    assert post(info, TEXTS[0])["status"] == 200


def test_a_stopped_worker_nodes_replica_comes_back_on_the_head(
        two_replicas: dict, nodes, watch: Watch) -> None:
    """The worker node stopped (`cluster.stop_node`: its raylet and replica go): Ray Serve
    starts its replica on the head, which has room for both; requests succeed. Last in the
    module: the worker stays stopped."""
    head, worker = nodes
    head_id = next(n for n, slots in watch.latest["nodes"].items() if slots == 2)
    stopped = time.monotonic()
    cluster.stop_node(worker.record())
    answers = [post(two_replicas, TEXTS[0])]
    back = watch.until(lambda s: s["running"] == 2 and len(alive(s)) == 2
                       and {r["node"] for r in alive(s)} == {head_id})
    answers += [post(two_replicas, text) for text in TEXTS[:20]]
    print(f"worker node stopped: both replicas running on the head {back['at'] - stopped:.1f} s "
          f"after the stop began; the first request after it: "
          f"{answers[0]['status']} in {answers[0]['done'] - answers[0]['sent']:.2f} s")
    assert list(back["nodes"]) == [head_id]
    assert [a["status"] for a in answers[1:]] == [200] * 20
    assert {a["replica"] for a in answers[1:]} <= {r["name"].rsplit("#", 1)[-1]
                                                  for r in alive(back)}
