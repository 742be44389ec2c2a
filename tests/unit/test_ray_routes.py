"""The Ray engine's replica app in one process, without a cluster: `routes.build_app` over
`runner.HandlerRunner` and a fake handler, through Starlette's test client. A stream's
chunks come as the handler sends them and a failure mid-stream ends it with a framed error
line; the token, the version and responseTimeout answer as
TorchServe does; every answer names its replica and node; the proxy's middleware answers
for a lost replica (a JSON 500, a stream's framed end). (Batching, Ray Serve's
`serve.batch`, needs a replica: tests/serving/test_ray_engine.py serves a batching
archive.)"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from fastapi.testclient import TestClient  # noqa: E402

from compress.serving.handler_host.context import HandlerContext  # noqa: E402
from compress.serving.handler_host.handler import token_digest  # noqa: E402
from compress.serving.ray.routes import LostReplica, build_app  # noqa: E402
from compress.serving.ray.runner import HandlerRunner  # noqa: E402

TOKEN = "s3cret"


class Streaming:
    """asyncCommunication: three chunks, then the answer (or a failure: body b"fail"; a
    hang: body b"hang")."""

    def handle(self, data, context):
        async def answer():
            out = []
            for i, request in enumerate(data):
                media = context.get_request_header(i, "accept") or "application/x-ndjson"
                context.set_response_content_type(i, media)
                if request["body"] == b"hang":
                    await asyncio.sleep(30)
                for k in range(3):
                    context.send_chunk(i, f"data: {k}\n\n" if "event-stream" in media
                                       else json.dumps({"delta": k}) + "\n")
                    await asyncio.sleep(0.005)
                if request["body"] == b"fail":
                    raise RuntimeError("secret internal detail /srv/weights.bin")
                out.append(json.dumps({"done": True}) + "\n")
            return out
        return answer()


def _client(handler, joining: bool, batch: int = 1, timeout_s: float = 5.0) -> TestClient:
    def context(ids=None, headers=None, send=None):
        return HandlerContext("fake", "/tmp", {}, {}, ids, headers, send,
                              server_name="Ray Serve")

    runner = HandlerRunner(handler, context, joining, batch, 0.05)
    app = build_app(runner, "fake", "1.0", token_digest(TOKEN), 1000, timeout_s,
                    "replica-1", "node-1")
    return TestClient(app)


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_stream_comes_in_chunks_and_a_failure_mid_stream_is_a_framed_error_line() -> None:
    with _client(Streaming(), joining=True) as client:
        answer = client.post("/predictions/fake/1.0/v1/x", content=b"ok", headers=AUTH)
        assert answer.status_code == 200
        assert answer.headers["x-compress-replica"] == "replica-1"
        assert answer.headers["x-compress-node"] == "node-1"
        lines = [json.loads(x) for x in answer.text.splitlines()]
        assert lines == [{"delta": 0}, {"delta": 1}, {"delta": 2}, {"done": True}]
        failed = client.post("/predictions/fake", content=b"fail", headers=AUTH)
        *chunks, last = failed.text.splitlines()
        assert len(chunks) == 3 and json.loads(last)["status"] == 500
        assert "error id" in json.loads(last)["error"] and "secret" not in failed.text
        sse = client.post("/predictions/fake", content=b"fail",
                          headers=AUTH | {"Accept": "text/event-stream"})
        events = [e for e in sse.text.split("\n\n") if e]
        assert events[:3] == ["data: 0", "data: 1", "data: 2"]
        assert json.loads(events[3].removeprefix("data: "))["error"]["code"] == 500


def test_token_version_limit_and_timeout_answer_as_torchserve() -> None:
    with _client(Streaming(), joining=True, timeout_s=0.5) as client:
        refused = client.post("/predictions/fake", content=b"ok",
                              headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused.json()["type"] == "InvalidKeyException"
        assert refused.headers["x-compress-replica"] == "replica-1"
        assert client.post("/predictions/fake/2.0", content=b"ok",
                           headers=AUTH).status_code == 404
        assert client.post("/predictions/other", content=b"ok", headers=AUTH).status_code == 404
        big = client.post("/predictions/fake", content=b"x" * 1001, headers=AUTH)
        assert big.status_code == 413 and big.json()["type"] == "RequestTooLargeException"
        late = client.post("/predictions/fake", content=b"hang", headers=AUTH)
        assert late.status_code == 504 and late.json()["type"] == "RequestTimeoutException"
        assert client.get("/ping").json() == {"status": "Healthy"}



def test_the_proxys_middleware_answers_for_a_lost_replica() -> None:
    """Ray Serve's proxy returns without an answer, or in the middle of a chunked one, when
    the replica's process dies: `LostReplica` answers TorchServe's JSON 500, or ends the
    stream with an error line in its framing; a whole answer passes untouched."""

    def proxy(kind: str):
        async def app(scope, receive, send) -> None:
            if kind == "lost":
                return
            media = {"sse": b"text/event-stream", "ndjson": b"application/x-ndjson",
                     "whole": b"application/json"}[kind]
            headers = [(b"content-type", media)]
            if kind == "whole":
                headers.append((b"content-length", b"2"))
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if kind == "whole":
                await send({"type": "http.response.body", "body": b"{}"})
                return
            first = b"data: 0\n\n" if kind == "sse" else b'{"delta": 0}\n'
            await send({"type": "http.response.body", "body": first, "more_body": True})
        return TestClient(LostReplica(app))

    lost = proxy("lost").post("/predictions/fake")
    assert lost.status_code == 500 and lost.json()["type"] == "InternalServerException"
    assert "not retried" in lost.json()["message"]
    events = proxy("sse").post("/predictions/fake").text.split("\n\n")
    assert events[0] == "data: 0" and events[2:] == [""]
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "lost" in error["message"]
    lines = proxy("ndjson").post("/predictions/fake").text.splitlines()
    assert json.loads(lines[0]) == {"delta": 0} and json.loads(lines[1])["status"] == 500
    assert proxy("whole").post("/predictions/fake").json() == {}
