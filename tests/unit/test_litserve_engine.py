"""The LitServe engine's two halves in one process: the API server's
routes (`TorchServeRoutes`) under a real uvicorn on a loopback port, and the worker's loop
(`HandlerLoop`) on a thread, joined by a queue and a transport as LitServe joins them (its
answers delivered into the routes' response buffer on the server's event loop).

The archive is a fake one written to a folder: `FAKE_HANDLER` answers by the URL's path
(`/predictions/fake/1.0/<path>`) and records what happens to its coroutines in `events`."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import queue
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litserve")

MAX_BODY = 1_000_000  # the engine's max_request_size in these tests
FORM = "application/x-www-form-urlencoded"

FAKE_HANDLER = '''import asyncio
import json


class Fake:
    """Answers by url_path: count (form fields), hang, stream, raise, echo."""

    def initialize(self, context):
        self.events = []

    def handle(self, data, context):
        return self._handle(data, context)

    async def _handle(self, data, context):
        return [await self._one(i, request, context) for i, request in enumerate(data)]

    async def _one(self, i, request, context):
        path = context.get_request_header(i, "url_path")
        if path == "count":
            return json.dumps({"fields": len(request)})
        if path == "raise":
            raise RuntimeError("secret internal detail /srv/weights.bin")
        if path in ("hang", "stream"):
            self.events.append("started")
            context.set_response_content_type(i, "application/x-ndjson")
            try:
                while True:
                    await asyncio.sleep(0.02)
                    if path == "stream":
                        context.send_chunk(i, json.dumps({"delta": "x"}) + "\\n")
            except asyncio.CancelledError:
                self.events.append("cancelled")
                raise
        return json.dumps({"bytes": len(request.get("body") or b"")})
'''


def write_archive(folder: Path, config: dict[str, Any], handler: str = FAKE_HANDLER,
                  file: str = "fake_handler.py") -> Path:
    """An unpacked fake archive: manifest, model-config.yaml, the handler's source in `file`
    (the fake handler unless given; another source needs another file name, as the module
    is imported by its name once a process)."""
    (folder / "MAR-INF").mkdir(parents=True)
    (folder / "MAR-INF/MANIFEST.json").write_text(json.dumps(
        {"model": {"modelName": "fake", "modelVersion": "1.0", "handler": file}}))
    (folder / "model-config.yaml").write_text(json.dumps(config))
    (folder / file).write_text(handler)
    return folder


class Transport:
    """The worker's answers into the routes' buffer on the server's loop, as LitServe's
    `response_queue_to_buffer` puts them (streaming specs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, buffer: dict) -> None:
        self.loop, self.buffer = loop, buffer

    def send(self, item: Any, consumer_id: int) -> None:
        self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: Any) -> None:
        from litserve.utils import LitAPIStatus

        uid, (data, status, _, worker_id) = item
        entry = self.buffer.get(uid)
        if entry is None:
            return
        if status == LitAPIStatus.START:
            entry.worker_id = worker_id
            return
        entry.response_queue.append((data, status))
        entry.event.set()


class Engine:
    """The fake archive served on 127.0.0.1:`port` by the engine's routes and loop."""

    def __init__(self, folder: Path, config: dict[str, Any], max_request_size: int) -> None:
        import uvicorn
        from fastapi import FastAPI
        from starlette.exceptions import HTTPException

        from compress.serving.handler_host.errors import http_error
        from compress.serving.litserve.worker import HandlerAPI

        model_dir = write_archive(folder / "model", config)
        (folder / "logs").mkdir()
        self.log = folder / "logs" / "model_log.log"
        self.api = HandlerAPI(model_dir, folder / "logs", None, max_request_size)
        self.api.setup("cpu")
        self.routes = self.api.spec
        self.routes.request_queue, self.routes.response_buffer = queue.Queue(), {}
        self.routes.response_queue_id = 0
        controls = [queue.Queue()]  # the worker's cancel queue (a Manager queue when served)
        self.api.loop.controls = self.routes.controls = controls
        self.routes.pre_setup(self.api)
        app = FastAPI()
        for path, endpoint, methods in self.routes.endpoints:
            app.add_api_route(path, endpoint, methods=methods)
        app.add_exception_handler(HTTPException, http_error)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/predictions/fake/1.0"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self.server.serve(),), daemon=True)
        self.thread.start()
        transport = Transport(self.loop, self.routes.response_buffer)
        threading.Thread(target=self._work, args=(transport,), daemon=True).start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def _work(self, transport: Transport) -> None:
        while True:
            self.api.loop.run(self.api, "cpu", 0, self.routes.request_queue, transport)

    @property
    def events(self) -> list[str]:
        return self.api.handler.events

    def wait_for(self, event: str, timeout_s: float) -> float | None:
        """Seconds until the handler recorded `event`, or None."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if event in self.events:
                return time.monotonic() - began
            time.sleep(0.01)
        return None

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        root = logging.getLogger()
        for handler in list(root.handlers):  # the model log HandlerAPI.setup added
            if getattr(handler, "baseFilename", None) == str(self.log):
                root.removeHandler(handler)
                handler.close()


@pytest.fixture
def fake(tmp_path: Path, request) -> Engine:
    """The engine with the test's model-config (indirect parameter), asyncCommunication on."""
    config = {"asyncCommunication": True, **getattr(request, "param", {})}
    served = Engine(tmp_path, config, max_request_size=MAX_BODY)
    yield served
    served.close()


def _post(url: str, body: bytes, content_type: str = "application/json",
          timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_form_of_more_than_the_field_cap_is_refused_at_once(fake: Engine) -> None:
    status, body = _post(f"{fake.url}/count", b"&".join(b"f%d=1" % i for i in range(100_000)), FORM)
    assert status in (400, 413), body[:200]
    assert b"form fields" in body
    status, body = _post(f"{fake.url}/count", b"a=1&b=2", FORM)
    assert status == 200 and json.loads(body) == {"fields": 2}


def test_an_endless_chunked_upload_gets_413_as_soon_as_it_passes_the_limit(
        fake: Engine) -> None:
    """The upload never ends: the 413 must come while it is still being sent."""
    sent, stop = [0], threading.Event()
    conn = socket.create_connection(("127.0.0.1", fake.port))
    conn.sendall(b"POST /predictions/fake/1.0/echo HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)

    def upload() -> None:
        try:
            while not stop.is_set():
                conn.sendall(piece)
                sent[0] += 64 * 1024
        except OSError:
            pass

    threading.Thread(target=upload, daemon=True).start()
    conn.settimeout(5)
    began = time.monotonic()
    try:
        head = conn.recv(4096)
    except (TimeoutError, OSError) as exc:
        head = repr(exc).encode()
    spent = time.monotonic() - began
    stop.set()
    conn.close()
    assert head.startswith(b"HTTP/1.1 413"), (head[:100], sent[0])
    assert spent < 1.0 and sent[0] < 20 * MAX_BODY, (spent, sent[0])


@pytest.mark.parametrize("fake", [{"responseTimeout": 1}], indirect=True)
def test_a_request_past_its_timeout_gets_504_and_its_coroutine_is_cancelled(
        fake: Engine) -> None:
    began = time.monotonic()
    status, body = _post(f"{fake.url}/hang", b"{}", timeout=10)
    spent = time.monotonic() - began
    assert status == 504 and json.loads(body)["code"] == 504, body
    assert 0.9 <= spent < 3, spent
    assert fake.wait_for("cancelled", 2) is not None, fake.events


def test_an_internal_error_answers_an_id_and_logs_the_traceback_under_it(
        fake: Engine) -> None:
    status, body = _post(f"{fake.url}/raise", b"{}")
    answer = json.loads(body)
    assert status == 500 and answer["code"] == 500, body
    assert "secret" not in body.decode() and "RuntimeError" not in body.decode()
    match = re.search(r"error id ([0-9a-f]{12})", answer["message"])
    assert match, answer
    log = fake.log.read_text()
    at = log.index(match.group(1))
    assert "Traceback" in log[at:] and "secret internal detail" in log[at:]


def test_a_streaming_client_that_leaves_cancels_its_coroutine(fake: Engine) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=10)
    conn.request("POST", "/predictions/fake/1.0/stream", body=b"{}",
                 headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 200
    assert [json.loads(answer.readline()) for _ in range(3)] == [{"delta": "x"}] * 3
    answer.close()
    conn.close()
    assert fake.wait_for("cancelled", 1.0) is not None, fake.events


def test_a_client_that_leaves_before_its_answer_cancels_its_coroutine(fake: Engine) -> None:
    status = None
    try:
        _post(f"{fake.url}/hang", b"{}", timeout=0.5)
    except (TimeoutError, OSError):
        status = "left"
    assert status == "left" and fake.wait_for("started", 1) is not None
    assert fake.wait_for("cancelled", 1.0) is not None, fake.events


def test_a_body_over_the_limit_sent_whole_still_reads_its_413(fake: Engine) -> None:
    """A client that sends its whole body before reading (http.client) gets the 413: the
    server drops the rest of the body rather than stalling the upload."""
    conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=10)
    conn.request("POST", "/predictions/fake/1.0/echo", body=b"x" * (10 * MAX_BODY),
                 headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 413 and json.loads(answer.read())["code"] == 413
    conn.close()
    assert _post(f"{fake.url}/echo", b"x" * 100)[0] == 200


def test_a_continuous_batching_archive_gets_one_request_a_batch(tmp_path: Path) -> None:
    """Each request's task can be cancelled alone and fails alone: batchSize is ignored."""
    from compress.serving.litserve.worker import HandlerAPI

    config = {"asyncCommunication": True, "batchSize": 8, "maxBatchDelay": 150}
    api = HandlerAPI(write_archive(tmp_path / "model", config), tmp_path, None, MAX_BODY)
    assert api.max_batch_size == 1 and api.timeout_s == 120
    (tmp_path / "plain").mkdir()
    plain = HandlerAPI(write_archive(tmp_path / "plain" / "model", {"batchSize": 8}),
                       tmp_path, None, MAX_BODY)
    assert plain.max_batch_size == 8
