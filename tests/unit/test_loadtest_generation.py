"""compress.serving.loadtest.generation against a local HTTP server that streams NDJSON in
chunks on a known schedule: time to first token, per-request decode rate, token throughput
and errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from compress.serving.loadtest.generation import (
    format_generation_table,
    load_prompts,
    run_generation_load,
    sweep_generation,
)

FIRST_S, GAP_S, TOKENS = 0.08, 0.02, 10


@pytest.fixture
def streaming_server() -> Iterator[str]:
    """Answers each POST with its first line after FIRST_S, then a line every GAP_S, then
    the final answer (TOKENS tokens); a body without "prompt" gets a 400; one asking for a
    single token gets the final answer alone, with a Content-Length and no chunks (as
    TorchServe answers a request that ends at its first token)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "prompt" not in body:
                out = b'{"error": "no prompt", "status": 400}'
                self.send_response(400)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            if body.get("max_new_tokens") == 1:
                out = json.dumps({"text": "", "finish_reason": "stop", "usage": {
                    "prompt_tokens": 3, "completion_tokens": 1}}).encode() + b"\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("X-Batch-Size", "2")
            self.end_headers()
            time.sleep(FIRST_S)
            for n in range(1, TOKENS):
                self._chunk(json.dumps({"delta": " w", "tokens": n}) + "\n")
                time.sleep(GAP_S)
            self._chunk(json.dumps({"text": " w" * TOKENS, "finish_reason": "length",
                                    "usage": {"prompt_tokens": 3,
                                              "completion_tokens": TOKENS}}) + "\n")
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, text: str) -> None:
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)  # shutdown() waits one poll
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/predictions/lm"
    server.shutdown()
    server.server_close()


def test_time_to_first_token_and_rates_follow_the_stream(streaming_server: str) -> None:
    payloads = load_prompts(None, max_new_tokens=TOKENS)
    assert json.loads(payloads[0]) == {"prompt": "What is the capital of France?",
                                       "max_new_tokens": TOKENS}
    run = run_generation_load(streaming_server, concurrency=3, requests=6, payloads=payloads)
    assert run["ok"] == 6 and run["errors"] == 0 and run["completion_tokens"] == 6 * TOKENS
    assert 1000 * FIRST_S <= run["ttft_ms_p50"] <= run["ttft_ms_p99"] < run["latency_ms_p50"]
    assert run["latency_ms_p50"] >= 1000 * (FIRST_S + (TOKENS - 1) * GAP_S)
    # 9 tokens after the first in (TOKENS - 1) * GAP_S: at most 50 tokens/s per request
    assert 15 < run["decode_tok_s_per_request"] <= 9 / (9 * GAP_S) + 1
    assert run["tokens_per_s"] == pytest.approx(6 * TOKENS / run["wall_s"], rel=0.01)
    assert run["batch_size_max"] == 2


def test_failed_requests_are_counted_and_the_table_reads(streaming_server: str) -> None:
    bodies = [b'{"prompt": "hi", "max_new_tokens": 10}', b'{"messages": []}']
    result = sweep_generation(streaming_server, [1, 2], 4, bodies)
    assert [(r["ok"], r["errors"]) for r in result["runs"]] == [(2, 2), (2, 2)]
    assert "HTTP 400" in result["runs"][0]["error_examples"][0]
    table = format_generation_table(result)
    assert "ttft p50 ms" in table.splitlines()[0] and "tokens/s at concurrency 2" in table
    assert "ttft p99 ms" in table.splitlines()[0]
    assert result["ttft_p50_ratio"] == pytest.approx(
        result["runs"][1]["ttft_ms_p50"] / result["runs"][0]["ttft_ms_p50"], abs=0.01)
    assert "time to first token p50 at concurrency 2 / concurrency 1" in table


def test_answers_of_one_line_keep_the_connection_usable(streaming_server: str) -> None:
    """A one-line answer with a Content-Length, then more requests on the same connection
    (http.client leaves such an answer open after readline; it failed every other request
    with ResponseNotReady)."""
    run = run_generation_load(streaming_server, concurrency=1, requests=5,
                              payloads=load_prompts(None, max_new_tokens=1))
    assert (run["ok"], run["errors"], run["completion_tokens"]) == (5, 0, 5)
