"""compress.serving.loadtest.predictions against a real local HTTP server: exact counts,
bounded concurrency, ordered percentiles, batch-size tallies, loopback-only URLs and argument
bounds."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from compress.errors import UserError
from compress.serving.loadtest.arguments import check_loopback
from compress.serving.loadtest.predictions import (
    format_table,
    rerank_payloads,
    run_load,
    sweep,
)

GOOD = [b'{"text": "a"}', b'{"text": "b"}', b'{"text": "c"}']
BAD = b"{not json"


class FakeTorchServe:
    """A threaded HTTP server that sleeps a little per POST and counts requests in flight."""

    def __init__(self, delay: float = 0.02, batch_size: int | None = None,
                 keep_alive: bool = True, drop_after_each: bool = False):
        self.delay = delay
        self.batch_size = batch_size  # fixed X-Batch-Size; None: in-flight count at arrival
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.received = 0
        self.content_types: set[str] = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(keep_alive,
                                                                          drop_after_each))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/predictions/tiny"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def _handler(self, keep_alive: bool, drop_after_each: bool) -> type:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with fake.lock:
                    fake.received += 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    batch = fake.in_flight if fake.batch_size is None else fake.batch_size
                    fake.content_types.add(self.headers.get("Content-Type", ""))
                time.sleep(fake.delay)
                # Leave before answering, so a client that waits for its answer can never
                # be counted twice.
                with fake.lock:
                    fake.in_flight -= 1
                try:
                    json.loads(body)
                except ValueError:
                    status, out = 400, b'{"code": 400, "message": "body is not JSON"}'
                else:
                    status, out = 200, json.dumps({"label": 1, "batch": batch}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                if status == 200:
                    self.send_header("X-Batch-Size", str(batch))
                self.end_headers()
                self.wfile.write(out)
                if drop_after_each:
                    # Close without saying "Connection: close": the client's next request on
                    # this connection finds it dead and has to reconnect.
                    self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        return Handler

    def __enter__(self) -> FakeTorchServe:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server() -> Iterator[FakeTorchServe]:
    with FakeTorchServe() as fake:
        yield fake


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_counts_concurrency_and_batch_sizes(server: FakeTorchServe) -> None:
    result = run_load(server.url, concurrency=4, requests=20, payloads=[*GOOD, BAD])

    assert result["concurrency"] == 4 and result["requests"] == 20
    assert result["ok"] == 15 and result["errors"] == 5  # every 4th body is malformed
    assert server.received == 20
    assert 1 < server.max_in_flight <= 4  # a bound: 2 cores do not always overlap all 4
    assert len(result["error_examples"]) == 3
    assert all(e.startswith("HTTP 400: ") and "not JSON" in e for e in result["error_examples"])

    p50, p90, p99 = (result[f"latency_ms_p{p}"] for p in (50, 90, 99))
    assert 0 < p50 <= p90 <= p99
    assert result["wall_s"] > 0 and result["throughput_rps"] > 0
    assert result["throughput_rps"] == pytest.approx(15 / result["wall_s"], rel=0.01)

    sizes = {int(k): v for k, v in result["batch_sizes"].items()}
    assert sum(sizes.values()) == result["ok"]
    assert set(sizes) <= {1, 2, 3, 4}
    assert result["batch_size_max"] == max(sizes) <= 4
    mean = sum(k * v for k, v in sizes.items()) / result["ok"]
    assert result["batch_size_mean"] == pytest.approx(mean, abs=0.01)


def test_in_flight_never_exceeds_concurrency(server: FakeTorchServe) -> None:
    for concurrency in (1, 3):
        server.max_in_flight = 0
        result = run_load(server.url, concurrency=concurrency, requests=9, payloads=GOOD)
        assert result["ok"] == 9 and result["errors"] == 0
        # never more than asked; with several workers, some overlap (2 cores: not always all)
        assert 1 <= server.max_in_flight <= concurrency
        assert concurrency == 1 or server.max_in_flight > 1
        assert result["batch_size_max"] <= concurrency


def test_warmup_is_sent_but_not_counted(server: FakeTorchServe) -> None:
    result = run_load(server.url, concurrency=2, requests=6, payloads=[*GOOD, BAD], warmup=3)
    assert server.received == 9
    assert result["requests"] == 6
    # Counting restarts at payload 0 after warmup: bodies 0..5 -> one malformed (index 3).
    assert result["ok"] == 5 and result["errors"] == 1


def test_fixed_batch_header_and_content_type() -> None:
    with FakeTorchServe(batch_size=8) as fake:
        result = run_load(fake.url, concurrency=2, requests=6, payloads=GOOD)
        assert result["batch_sizes"] == {"8": 6}
        assert result["batch_size_mean"] == 8 and result["batch_size_max"] == 8
        assert fake.content_types == {"application/json"}

        run_load(fake.url, 1, 2, GOOD, headers={"content-type": "text/plain", "X-Extra": "1"})
        assert fake.content_types == {"application/json", "text/plain"}


@pytest.mark.parametrize("keep_alive,drop_after_each", [(False, False), (True, True)])
def test_reconnects_when_server_closes(keep_alive: bool, drop_after_each: bool) -> None:
    with FakeTorchServe(delay=0.005, keep_alive=keep_alive,
                        drop_after_each=drop_after_each) as fake:
        result = run_load(fake.url, concurrency=3, requests=12, payloads=GOOD)
    assert result["ok"] == 12 and result["errors"] == 0, result["error_examples"]
    assert fake.received == 12


def test_connection_errors_are_counted() -> None:
    url = f"http://127.0.0.1:{_free_port()}/predictions/x"
    result = run_load(url, concurrency=2, requests=5, payloads=GOOD, timeout=5)
    assert result["ok"] == 0 and result["errors"] == 5
    assert 1 <= len(result["error_examples"]) <= 3
    assert all("Connection" in e or "refused" in e for e in result["error_examples"])
    assert result["throughput_rps"] == 0
    assert result["latency_ms_p50"] is None and result["latency_ms_p99"] is None
    assert result["batch_sizes"] == {} and result["batch_size_mean"] is None


def test_sweep_ratio_and_table(server: FakeTorchServe) -> None:
    result = sweep(server.url, [1, 2, 4], requests=12, payloads=GOOD, warmup=2)
    assert result["url"] == server.url
    assert [r["concurrency"] for r in result["runs"]] == [1, 2, 4]
    assert all(r["ok"] == 12 and r["errors"] == 0 for r in result["runs"])
    low, high = result["runs"][0]["throughput_rps"], result["runs"][-1]["throughput_rps"]
    assert result["throughput_ratio"] == pytest.approx(high / low, abs=0.01)
    assert server.received == 3 * (12 + 2)

    table = format_table(result)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 1
    assert "concurrency" in lines[0] and "p99 ms" in lines[0] and "batch max" in lines[0]
    assert len({len(line) for line in lines[:5]}) == 1  # fixed width
    assert lines[2].split()[:4] == ["1", "12", "12", "0"]
    assert lines[-1] == ("throughput at concurrency 4 / concurrency 1: "
                         f"{result['throughput_ratio']:.2f}x")


def test_sweep_ratio_none_when_nothing_succeeds() -> None:
    url = f"http://127.0.0.1:{_free_port()}/predictions/x"
    result = sweep(url, [1, 2], requests=2, payloads=GOOD)
    assert result["throughput_ratio"] is None
    assert format_table(result).splitlines()[-1].endswith(": n/a")


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/predictions/x",
                                 "http://localhost:8080/predictions/m",
                                 "http://[::1]:8080/predictions/m"])
def test_check_loopback_accepts(url: str) -> None:
    assert check_loopback(url) is None  # no error for a loopback address


@pytest.mark.parametrize("url,word", [("http://example.com:8080/", "example.com"),
                                      ("https://127.0.0.1:8443/predictions/x", "https"),
                                      ("http://10.0.0.5:8080/predictions/x", "10.0.0.5"),
                                      ("127.0.0.1:8080/predictions/x", "scheme")])
def test_check_loopback_rejects(url: str, word: str) -> None:
    with pytest.raises(UserError) as info:
        check_loopback(url)
    assert len(info.value.messages) == 1 and word in info.value.messages[0]
    message = info.value.messages[0]
    assert "\n" not in message and word in message and "127.0.0.1" in message


@pytest.mark.parametrize("kwargs,word", [({"concurrency": 0}, "concurrency"),
                                         ({"concurrency": 257}, "concurrency"),
                                         ({"requests": 0}, "requests"),
                                         ({"requests": 100_001}, "requests"),
                                         ({"warmup": -1}, "warmup"),
                                         ({"payloads": []}, "payloads")])
def test_bounds(kwargs: dict, word: str) -> None:
    args = {"url": "http://127.0.0.1:1/predictions/x", "concurrency": 1, "requests": 1,
            "payloads": GOOD, **kwargs}
    with pytest.raises(UserError) as info:
        run_load(**args)
    assert len(info.value.messages) == 1 and "\n" not in info.value.messages[0]
    assert word in info.value.messages[0]


def test_sweep_checks_every_concurrency_and_url() -> None:
    with pytest.raises(UserError, match="concurrency"):
        sweep("http://127.0.0.1:1/x", [1, 300], requests=1, payloads=GOOD)
    with pytest.raises(UserError, match="example.com"):
        sweep("http://example.com/x", [1], requests=1, payloads=GOOD)
    with pytest.raises(UserError, match="concurrencies"):
        sweep("http://127.0.0.1:1/x", [], requests=1, payloads=GOOD)


def test_rerank_payloads_send_each_line_as_a_query_with_the_lines_after_it(tmp_path) -> None:
    lines = tmp_path / "texts.txt"
    lines.write_text("q0\n\nq1\nq2\n")
    bodies = [json.loads(b) for b in rerank_payloads(str(lines), documents=4)]
    assert bodies == [{"query": "q0", "documents": ["q1", "q2", "q0", "q1"]},
                      {"query": "q1", "documents": ["q2", "q0", "q1", "q2"]},
                      {"query": "q2", "documents": ["q0", "q1", "q2", "q0"]}]
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(UserError, match="no text lines"):
        rerank_payloads(str(tmp_path / "blank.txt"))
