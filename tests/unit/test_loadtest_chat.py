"""compress.serving.loadtest.chat against a local HTTP server that streams OpenAI chat
completion chunks as server-sent events on a known schedule: time to first token (a
role-only first event is no token), inter-token latency percentiles, completion tokens
from usage (in the last chunk as compress sends it, or in a chunk of its own as
llama-server does) or counted, errors; the shared-prefix workload and the CLI."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from compress.errors import UserError
from compress.serving.loadtest.chat import format_chat_table, is_chat_url, run_chat_load, sweep_chat
from compress.serving.loadtest.chat_workload import chat_payloads, shared_prefix_text
from tests.conftest import cli

FIRST_S, GAP_S, LONG_S, TOKENS = 0.1, 0.01, 0.15, 10
USAGE_TOKENS = 17  # what usage says: not the number of content events, to tell them apart
PROMPTS = ["What is the capital of France?", "Name three colours."]


@pytest.fixture
def sse_server() -> Iterator[tuple[str, list[dict]]]:
    """(base URL, the bodies it received). Under /compress/ the usage rides the chunk with
    finish_reason, under /llama/ a chunk with no choices of its own, under /nousage/ none.
    Each answer: a role-only event at once, the first content after FIRST_S, an empty
    content event (no token), then TOKENS - 1 more content events GAP_S apart, except one
    gap of LONG_S; then the final chunk(s) and [DONE]; under /quick-STYLE/ the same without
    the waits (for the tests that count, not time). A body without messages gets a 400,
    max_tokens 2 a stream cut before [DONE], max_tokens 3 an error event."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(body)
            if "messages" not in body:
                out = b'{"error": {"message": "messages is required"}}'
                self.send_response(400)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            style = self.path.split("/")[1]
            waits = not style.startswith("quick-")
            style = style.removeprefix("quick-")
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            time.sleep(FIRST_S * waits)
            if body["max_tokens"] == 3:
                self._event({"error": {"message": "the worker died"}})
                self._end()
                return
            for n in range(TOKENS):
                if n:
                    time.sleep((LONG_S if n == 5 else GAP_S) * waits)
                self._event({"choices": [{"index": 0, "delta": {"content": f" w{n}"}}]})
                if n == 0:
                    self._event({"choices": [{"index": 0, "delta": {"content": ""}}]})
            if body["max_tokens"] == 2:
                self._end()
                return
            usage = {"prompt_tokens": 5, "completion_tokens": USAGE_TOKENS}
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            if style == "compress":
                self._event(last | {"usage": usage})
            elif style == "llama":
                self._event(last)
                self._event({"choices": [], "usage": usage})
            else:
                self._event(last)
            self._chunk(b"data: [DONE]\n\n")
            self._end()

        def _event(self, body: dict) -> None:
            self._chunk(f"data: {json.dumps(body)}\n\n".encode())

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _end(self) -> None:
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)  # shutdown() waits one poll
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


def test_ttft_itl_and_usage_tokens_follow_the_stream(sse_server) -> None:
    base, received = sse_server
    payloads = chat_payloads(PROMPTS, max_tokens=64, count=8)
    run = run_chat_load(f"{base}/compress/v1/chat/completions", concurrency=3, requests=6,
                        payloads=payloads, warmup=2)
    assert (run["ok"], run["errors"]) == (6, 0)
    assert run["completion_tokens"] == 6 * USAGE_TOKENS and run["tokens_from"] == "usage"
    assert run["prompt_tokens_mean"] == 5
    # the role-only event came at once: the first token is the first content, FIRST_S later
    assert 1000 * FIRST_S <= run["ttft_ms_p50"] <= run["ttft_ms_p99"] < 1000 * LONG_S * 3
    # 9 gaps an answer, one of them long: p50 a short gap, p99 the long one
    assert 1000 * GAP_S <= run["itl_ms_p50"] < 1000 * LONG_S
    assert run["itl_ms_p99"] >= 1000 * LONG_S
    assert run["tokens_per_s"] == pytest.approx(6 * USAGE_TOKENS / run["wall_s"], rel=0.01)
    assert run["latency_ms_p50"] >= 1000 * (FIRST_S + LONG_S + 8 * GAP_S)
    sent = [b for b in received]
    assert len(sent) == 8 and all(b["stream"] and b["temperature"] == 0 for b in sent)
    assert all(b["stream_options"] == {"include_usage": True} for b in sent)


@pytest.mark.parametrize("style, tokens, source", [
    ("llama", USAGE_TOKENS, "usage"), ("nousage", TOKENS, "chunks")])
def test_tokens_from_usage_of_its_own_chunk_or_counted(sse_server, style: str, tokens: int,
                                                       source: str) -> None:
    base, _ = sse_server
    run = run_chat_load(f"{base}/quick-{style}/v1/chat/completions", concurrency=2, requests=4,
                        payloads=chat_payloads(PROMPTS, 64, 4))
    assert (run["ok"], run["completion_tokens"], run["tokens_from"]) == (
        4, 4 * tokens, source)
    assert run["tokens_per_request"] == tokens


def test_failures_are_counted_each_with_its_cause(sse_server) -> None:
    base, _ = sse_server
    bodies = [b'{"prompt": "no messages"}', chat_payloads(PROMPTS, 2, 1)[0],
              chat_payloads(PROMPTS, 3, 1)[0], chat_payloads(PROMPTS, 64, 1)[0]]
    run = run_chat_load(f"{base}/quick-llama/v1/chat/completions", concurrency=1, requests=4,
                        payloads=bodies)
    assert (run["ok"], run["errors"]) == (1, 3)
    causes = " | ".join(run["error_examples"])
    assert "HTTP 400" in causes and "without data: [DONE]" in causes
    assert "the worker died" in causes
    assert run["completion_tokens"] == USAGE_TOKENS  # the one good answer alone


def test_sweep_ratio_and_table(sse_server) -> None:
    base, _ = sse_server
    result = sweep_chat(f"{base}/quick-compress/v1/chat/completions", [1, 2], 4,
                        chat_payloads(PROMPTS, 64, 4))
    table = format_chat_table(result)
    header = table.splitlines()[0]
    assert all(word in header for word in ("ttft p50 ms", "ttft p99 ms", "itl p50 ms",
                                           "itl p99 ms", "tok/s", "errors"))
    runs = result["runs"]
    assert result["tokens_per_s_ratio"] == pytest.approx(
        runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], abs=0.01)
    assert "tokens/s at concurrency 2 / concurrency 1" in table


def test_shared_prefix_payloads() -> None:
    bodies = [json.loads(b) for b in chat_payloads(PROMPTS, 64, 5, shared_prefix=128,
                                                   extra={"ignore_eos": True})]
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in bodies)
    questions = [b["messages"][1]["content"] for b in bodies]
    assert len(set(questions)) == 5 and questions[2].endswith(PROMPTS[0])
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 64 for b in bodies)
    text = systems.pop()
    # one common word or full stop a token: the words and stops add up to the size asked
    assert len(text.split()) + text.count(".") == 128
    assert shared_prefix_text(128) == text and shared_prefix_text(512) != text
    with pytest.raises(UserError, match="shared prefix"):
        shared_prefix_text(0)


def test_chat_urls() -> None:
    assert is_chat_url("http://127.0.0.1:8080/predictions/lm/v1/chat/completions")
    assert is_chat_url("http://127.0.0.1:8081/v1/chat/completions/")
    assert not is_chat_url("http://127.0.0.1:8080/predictions/lm")


def test_cli_openai_mode_and_its_bad_arguments(sse_server, monkeypatch, capsys) -> None:
    from click.testing import CliRunner

    from compress.cli.main import cli as compress

    base, received = sse_server
    done = CliRunner().invoke(compress, [
        "loadtest", f"{base}/quick-llama/v1/chat/completions", "--concurrency", "1,2", "--requests",
        "2", "--warmup", "1", "--shared-prefix", "32", "--ignore-eos", "--max-new-tokens", "8"])
    assert done.exit_code == 0, done.output
    out = done.output
    assert "itl p99 ms" in out and "tokens/s at concurrency 2 / concurrency 1" in out
    assert all(b["ignore_eos"] and len(b["messages"]) == 2 for b in received)
    code, _, err = cli(monkeypatch, capsys, "loadtest", f"{base}/predictions/lm",
                       "--task", "causal-lm", "--shared-prefix", "32")
    assert code == 2 and "--shared-prefix and --ignore-eos are for OpenAI's API" in err
    assert len(err.strip().splitlines()) == 1
