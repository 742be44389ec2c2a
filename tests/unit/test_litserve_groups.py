"""The LitServe engine's requests in groups: the API server puts the requests it reads in one
pass of its event loop on the manager's queue as one item (at most a batch of them), and a
worker splits what it gets into batches of `batchSize`, keeping the rest for its next batch."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litserve")
from test_litserve_engine import write_archive  # noqa: E402

RECORDER = '''import json


class Recorder:
    """Answers each request with the size of the batch it came in."""

    def initialize(self, context):
        self.sizes = []

    def handle(self, data, context):
        self.sizes.append(len(data))
        return [json.dumps({"batch": len(data)}) for _ in data]
'''


class Sent:
    """The worker's transport: every message it sends, by request id."""

    def __init__(self) -> None:
        self.ends: dict[str, bytes] = {}

    def send(self, item: Any, consumer_id: int) -> None:
        _, (items, _, _, _) = item
        for uid, (kind, _, _, _, data) in items:
            if kind == "end":
                self.ends[uid] = data


def test_requests_read_in_one_pass_go_in_groups_of_a_batch() -> None:
    from compress.serving.litserve.routes import TorchServeRoutes

    routes = TorchServeRoutes("rec", "1.0", 1000)
    routes.group_size = 3
    puts: list[list[tuple]] = []
    routes.request_queue = type("Q", (), {"put": staticmethod(puts.append)})()

    async def read_seven() -> None:
        for k in range(7):
            routes._enqueue((0, f"u{k}", 0.0, None))
        assert puts == []  # sent once the pass that read them is over
        await asyncio.sleep(0)

    asyncio.run(read_seven())
    assert [[uid for _, uid, _, _ in group] for group in puts] == [
        ["u0", "u1", "u2"], ["u3", "u4", "u5"], ["u6"]]


def test_a_group_that_cannot_be_queued_ends_its_requests_with_503() -> None:
    from compress.serving.litserve.inflight import Pending
    from compress.serving.litserve.routes import TorchServeRoutes

    routes = TorchServeRoutes("rec", "1.0", 1000)
    routes.group_size = 4

    class Gone:
        def put(self, item: Any) -> None:
            raise OSError("the manager is gone")

    routes.request_queue, routes.response_buffer = Gone(), {}

    async def read_two() -> list[Pending]:
        pending = [Pending(event=asyncio.Event(), response_queue=deque(), uid=f"u{k}")
                   for k in range(2)]
        for one in pending:
            routes.response_buffer[one.uid] = one
            routes._enqueue((0, one.uid, 0.0, None))
        await asyncio.sleep(0)
        return pending

    for one in asyncio.run(read_two()):
        (kind, status, _, _, body), _ = one.response_queue[0]
        assert (kind, status, one.ended) == ("fail", 503, True)
        assert b"stopping" in body


def test_a_worker_splits_a_group_into_batches_and_keeps_the_rest(tmp_path: Path) -> None:
    from compress.serving.litserve.worker import HandlerAPI

    api = HandlerAPI(write_archive(tmp_path / "model", {"batchSize": 2, "maxBatchDelay": 0},
                                   RECORDER, "recorder.py"), tmp_path, None, 1000)
    api.setup("cpu")
    try:
        _split_and_answer(api)
    finally:
        for handler in list(logging.getLogger().handlers):  # the model log setup added
            if str(getattr(handler, "baseFilename", "")).startswith(str(tmp_path)):
                logging.getLogger().removeHandler(handler)
                handler.close()


def _split_and_answer(api: Any) -> None:
    requests: queue.Queue = queue.Queue()
    requests.put([(0, f"u{k}", time.monotonic(), ({"body": b"x"}, {"url_path": ""}))
                  for k in range(5)])
    sent = Sent()
    for _ in range(3):
        api.loop.run(api, "cpu", 0, requests, sent)
    assert api.handler.sizes == [2, 2, 1]
    deadline = time.monotonic() + 5
    while len(sent.ends) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {uid: json.loads(body)["batch"] for uid, body in sent.ends.items()} == {
        "u0": 2, "u1": 2, "u2": 2, "u3": 2, "u4": 1}
    api.loop.run(api, "cpu", 0, requests, sent)  # nothing left: an idle get, no batch
    assert api.handler.sizes == [2, 2, 1]
