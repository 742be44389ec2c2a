"""benchmarks/causal_lm/served*.py without real servers: bad arguments as one error line,
archive copies with handler settings, the rows and ratios of the table, a process tree's
resident memory, and a whole round against a stand-in `llama-server` (a small Python
server speaking the same streamed chat completions): its command line, cold start,
figures, memory, and that it is stopped."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import yaml

from benchmarks.causal_lm import served as serve_peers_llm
from benchmarks.causal_lm import served_archives as archives
from benchmarks.causal_lm import served_items as items_of
from benchmarks.causal_lm import served_table as table
from benchmarks.harness import servers


@pytest.mark.parametrize("args, message", [
    (["--schemes", "int3"], "unknown scheme 'int3' (known: int8, int4)"),
    (["--engines", "tgi"], "unknown engine 'tgi'"),
    (["--quants", "Q5_K"], "unknown llama-server file 'Q5_K'"),
    (["--concurrency", "1,x"], "--concurrency '1,x': expected numbers"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--prompts", "/nowhere/prompts.txt"], "--prompts /nowhere/prompts.txt: no such file"),
    (["--shared-prefix", "0"], "--shared-prefix must be at least 1"),
    (["--requests", "many"], "argument --requests: invalid int value"),
])
def test_bad_arguments_are_one_error_line(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        serve_peers_llm.main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_quick_defaults_and_explicit_arguments_win() -> None:
    quick = serve_peers_llm.parse_args(["--quick"])
    assert (quick.rounds, quick.levels, quick.requests, quick.schemes) == (1, [1, 8], 8,
                                                                           ["int8"])
    assert quick.quants == ["Q8_0"]  # the files paired with the schemes measured
    assert serve_peers_llm.parse_args([]).quants == ["Q8_0", "Q4_0", "Q4_1"]
    full = serve_peers_llm.parse_args(["--quick", "--concurrency", "1,4", "--no-llama"])
    assert full.levels == [1, 4] and full.quants == [] and full.rounds == 1
    prefix = serve_peers_llm.parse_args(["--shared-prefix", "512"])
    assert prefix.quants == [] and prefix.markdown.name == "serve_peers_llm_prefix.md"


def _mar(path: Path, handler: dict) -> Path:
    with zipfile.ZipFile(path, "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps(
            {"model": {"modelName": "llm_int8", "modelVersion": "1.0"}}))
        mar.writestr("model-config.yaml", yaml.safe_dump(
            {"batchSize": 1, "asyncCommunication": True, "handler": handler}))
        mar.writestr("weights.bin", b"\x00\x01" * 100)
    return path


def test_archive_facts_and_a_copy_with_handler_settings(tmp_path: Path) -> None:
    mar = _mar(tmp_path / "llm_int8.mar", {"task": "causal-lm", "cache_len": 512, "rows": 8})
    facts = archives.archive_facts(mar)
    assert (facts["model_name"], facts["version"], facts["cache_len"], facts["rows"]) == (
        "llm_int8", "1.0", 512, 8)
    assert facts["prefix_cache"] is None
    copy = archives.with_handler_settings(mar, tmp_path / "on", {"prefix_cache": True,
                                                                 "cache_len": 640})
    assert copy == tmp_path / "on" / "llm_int8.mar"
    changed = archives.archive_facts(copy)
    assert (changed["prefix_cache"], changed["cache_len"], changed["rows"]) == (True, 640, 8)
    with zipfile.ZipFile(copy) as made:
        assert made.read("weights.bin") == b"\x00\x01" * 100
        assert yaml.safe_load(made.read("model-config.yaml"))["asyncCommunication"] is True
    assert archives.archive_facts(mar)["cache_len"] == 512  # the original is unchanged
    # 512 + 64 + 64 = 640 positions: more than the archive's 512, a multiple of 64
    assert archives.prefix_cache_len(facts, 512, 64) == 640
    assert archives.prefix_cache_len(facts, 100, 64) == 512
    bert = _mar(tmp_path / "bert.mar", {"task": "classification"})
    with pytest.raises(archives.PeerError, match="not a causal LM's archive"):
        archives.archive_facts(bert)


def _run(level: int, tok_s: float, ttft: float, errors: int = 0) -> dict:
    return {"concurrency": level, "tokens_per_s": tok_s, "ttft_ms_p50": ttft,
            "ttft_ms_p99": 2 * ttft, "itl_ms_p50": 10.0, "itl_ms_p99": 30.0,
            "tokens_per_request": 64.0, "errors": errors}


def test_rows_take_medians_over_rounds_and_the_ratios_pair_the_schemes() -> None:
    ours = {"key": "ts-int8", "name": "compress torchserve", "engine": "torchserve",
            "scheme": "llm_int8", "pairs": ("Q8_0",), "rounds": [
                {"cold_start_s": 30.0, "rss_peak_bytes": 900 * 2**20,
                 "runs": [_run(1, 100, 50), _run(8, 300, 80, errors=1)]},
                {"cold_start_s": 40.0, "rss_peak_bytes": 1000 * 2**20,
                 "runs": [_run(1, 110, 70), _run(8, 340, 100)]},
                {"error": "no answer", "rss_peak_bytes": 0}]}
    peer = {"key": "llama-Q8_0", "name": "llama-server", "engine": "llama-server",
            "scheme": "Q8_0", "pairs": (), "rounds": [
                {"cold_start_s": 1.0, "rss_peak_bytes": 300 * 2**20,
                 "runs": [_run(1, 105, 40), _run(8, 200, 90)]}]}
    rows = table.table_rows([ours, peer], [1, 8])
    mine8 = rows[1]
    assert (mine8["tokens_per_s"], mine8["ttft_ms_p50"], mine8["errors"]) == (320.0, 90.0, 1)
    assert (mine8["cold_start_s"], mine8["rss_mb"], mine8["rounds"]) == (35.0, 1000, 2)
    lines = table.ratios([ours, peer], rows, [1, 8])
    assert lines[0] == ("compress torchserve llm_int8 / llama-server Q8_0: tok/s at c8 1.60x, "
                        "TTFT p50 at c1 1.50x, at c8 1.00x")
    assert lines[1] == "compress torchserve llm_int8: tok/s at c8 / c1 3.05x"
    text = table.render_text(rows, lines)
    assert "TTFT p99 ms" in text.splitlines()[0] and "llama-server" in text
    header = {"title": "T", "date": "d", "cpu": {"cpu": "CPU", "cores": 2, "flags": "avx2"},
              "command": "python -m benchmarks.causal_lm.served", "facts": {"torch": "2"},
              "notes": ["a note"]}
    markdown = table.render_markdown(rows, lines, header)
    assert "| compress torchserve | llm_int8 | 8 | 320.0 |" in markdown
    assert "- flags: avx2" in markdown and "- a note" in markdown


def test_prefix_cache_ratio() -> None:
    def item(cache: bool, ttft: float) -> dict:
        return {"key": f"ts-{cache}", "name": f"compress torchserve cache-{cache}",
                "engine": "torchserve", "scheme": "llm_int8", "pairs": (),
                "prefix_cache": cache, "rounds": [{"runs": [_run(1, 100, ttft)]}]}
    items = [item(False, 200.0), item(True, 50.0)]
    lines = table.ratios(items, table.table_rows(items, [1]), [1])
    assert lines == ["compress torchserve llm_int8: TTFT p50 with the prefix cache / without "
                     "at c1 0.25x"]


def test_tree_rss_counts_the_children() -> None:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        alone = int(Path(f"/proc/{child.pid}/statm").read_text().split()[1]) * os.sysconf(
            "SC_PAGE_SIZE")
        assert servers.tree_rss_bytes(os.getpid()) > alone > 0
    finally:
        child.kill()
        child.wait()
    assert servers.tree_rss_bytes(child.pid) == 0


FAKE_SERVER = '''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
with open(args[args.index("-m") + 1] + ".args", "a") as out:
    out.write(json.dumps({"pid": os.getpid(), "args": args}) + "\\n")
time.sleep(0.3)  # loading the model


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "ignore_eos" in body and os.environ.get("FAKE_REFUSES_IGNORE_EOS"):
            out = b'{"error": {"message": "unsupported field ignore_eos"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        n = body["max_tokens"] if body.get("ignore_eos") else 1
        if not body.get("stream"):
            out = json.dumps({"choices": [{"message": {"content": "x"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"delta": {"content": " t"}}]} for _ in range(n)]
        events.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}})
        for event in events:
            data = f"data: {json.dumps(event)}\\n\\n".encode()
            self.wfile.write(f"{len(data):x}\\r\\n".encode() + data + b"\\r\\n")
            time.sleep(0.002)
        data = b"data: [DONE]\\n\\n"
        self.wfile.write(f"{len(data):x}\\r\\n".encode() + data + b"\\r\\n0\\r\\n\\r\\n")

    def log_message(self, *a):
        pass


port = int(args[args.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_a_round_against_a_stand_in_llama_server(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(FAKE_SERVER))
    fake.chmod(0o755)
    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "prompts.txt").write_text("What is the capital of France?\nName a colour.\n")
    args = argparse.Namespace(quants=["Q8_0"], levels=[1, 2], requests=4, max_tokens=6,
                              shared_prefix=None, prompts=tmp_path / "prompts.txt",
                              start_timeout=60, rounds=2)
    facts = {"cache_len": 256}
    items = items_of.peer_items(args, {"int8": (None, None, facts)}, {"Q8_0": gguf}, fake)
    said: list[str] = []
    items_of.measure(items, args, tmp_path, said.append)
    rounds = items[0]["rounds"]
    assert len(rounds) == 2 and not any("error" in r for r in rounds), said
    starts = [json.loads(line) for line in
              (tmp_path / "model.Q8_0.gguf.args").read_text().splitlines()]
    assert len(starts) == 2  # started once a round
    command = starts[0]["args"]
    assert command[command.index("-np") + 1] == "8"
    assert command[command.index("-c") + 1] == str(8 * 256)
    assert command[command.index("-t") + 1] == str(os.cpu_count())
    assert command[command.index("--host") + 1] == "127.0.0.1"
    for figures in rounds:
        assert figures["cold_start_s"] >= 0.3 and figures["rss_peak_bytes"] > 2**20
        assert figures["ignore_eos"] is True
        assert [r["concurrency"] for r in figures["runs"]] == [1, 2]
        for run in figures["runs"]:  # ignore_eos sent: every answer max_tokens long
            assert (run["ok"], run["completion_tokens"], run["tokens_from"]) == (4, 24, "usage")
    assert not any(Path(f"/proc/{start['pid']}").exists() for start in starts)  # stopped
    assert "round 2/2: llama-server Q8_0: cold start" in said[-1]
    # a server that refuses ignore_eos (an archive made before compress took it) gets
    # requests without it, and its answers end where it ends them
    monkeypatch.setenv("FAKE_REFUSES_IGNORE_EOS", "1")
    args.rounds = 1
    again = items_of.peer_items(args, {"int8": (None, None, facts)}, {"Q8_0": gguf}, fake)
    items_of.measure(again, args, tmp_path, said.append)
    (figures,) = again[0]["rounds"]
    assert figures["ignore_eos"] is False and "ignore_eos refused" in said[-1]
    assert [(r["ok"], r["completion_tokens"]) for r in figures["runs"]] == [(4, 4), (4, 4)]

