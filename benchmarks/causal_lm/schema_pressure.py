"""Plain chat requests' time to first token while one client sends large JSON schemas: issue
70's figure for "no request holds the worker's parse thread". From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.schema_pressure
    python -m benchmarks.causal_lm.schema_pressure --run runs/llm_int8 --rounds 5

On each engine (`compress serve --engine torchserve|litserve`, started once, warmed up):
the largest `response_format` json_schema that the archive accepts and llguidance compiles
(an anyOf of one-key objects, as long as the archive's `max_schema_chars` allows, shrunk
until a probe with it answers 200) is found first. Then each round measures, in an order
that alternates between rounds, 16 plain streamed greedy chat requests sent at once
(`compress.serving.loadtest.chat`): alone, and while one client sends a schema request
with n=8 every 100 ms (open loop: each in its own connection, whether or not the last was
answered). A schema request's text differs from the last one's (a key renamed at the same
length), so the worker's cache of compiled schemas does not hold it and every one is
compiled; `--same-schema` sends one text throughout. The figure: the plain requests' TTFT
p50 under pressure over their TTFT p50 alone, by median and by best round, with each
phase's spread; the target is 1.5x or less. Exit 2: bad arguments; 1: a server failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.causal_lm import served_archives as archives
from benchmarks.causal_lm.served_servers import Server
from benchmarks.harness import servers
from benchmarks.harness.cli import Parser, echo, exit_code
from benchmarks.harness.paths import REPO
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from benchmarks.harness.rounds import alternating
from benchmarks.harness.spread import spread
from compress.errors import UserError
from compress.serving.loadtest.chat import run_chat_load
from compress.serving.loadtest.chat_workload import chat_payloads, read_prompts
from serve.handler_settings import HandlerSettings

ENGINES = ("torchserve", "litserve")
MODULE = "benchmarks.causal_lm.schema_pressure"
TARGET_RATIO = 1.5
SETTLE_S = 1.0  # the schema client runs this long before the plain requests are sent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=REPO / "runs" / "llm_int8",
                        help="a causal LM's run folder or .mar (runs/llm_int8, made with "
                             "compress run recipes/llm_int8.yaml when missing)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"({','.join(ENGINES)})")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alone and under "
                        "pressure, in alternating order (3)")
    parser.add_argument("--plain", type=int, default=16, help="plain chat requests sent at "
                        "once a phase (16)")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens a plain "
                        "request (8)")
    parser.add_argument("--every-ms", type=int, default=100, help="the schema client's "
                        "period (100)")
    parser.add_argument("--n", type=int, default=8, help="choices a schema request (8)")
    parser.add_argument("--schema-max-tokens", type=int, default=1, help="new tokens a "
                        "schema request's choice (1: its cost is parsing and compiling)")
    parser.add_argument("--same-schema", action="store_true", help="one schema text "
                        "throughout (compiled once, then taken from the worker's cache)")
    parser.add_argument("--prompts", type=Path, default=REPO / "recipes/prompts/chat20.txt",
                        help="chat prompts, one a line (recipes/prompts/chat20.txt)")
    parser.add_argument("--start-timeout", type=int, default=900,
                        help="seconds a server may take to answer its first request (900)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    args.engines = [e for e in args.engines.split(",") if e]
    problems = [f"unknown engine {e!r} (known: {', '.join(ENGINES)})"
                for e in args.engines if e not in ENGINES]
    problems += [f"--{n.replace('_', '-')} must be at least 1" for n in (
        "rounds", "plain", "max_tokens", "every_ms", "n", "schema_max_tokens",
        "start_timeout") if getattr(args, n) < 1]
    problems += [f"--prompts {args.prompts}: no such file"] if not args.prompts.is_file() else []
    problems += ["no engine to measure"] if not args.engines else []
    if problems:
        parser.error("; ".join(problems))
    return args


def wide_schema(branches: int, tag: str) -> dict[str, Any]:
    """An anyOf of `branches` one-key objects whose keys start with `tag`: its text grows
    with `branches`, and so does its compilation (about 3 us a character)."""
    return {"anyOf": [{"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}},
                       "required": [f"{tag}{i}"], "additionalProperties": False}
                      for i in range(branches)]}


def branches_within(chars: int, tag: str) -> int:
    """The most branches whose schema's JSON text is at most `chars` characters (found by
    halving: the length grows with the count)."""
    low, high = 1, max(2, chars // 40)
    while high - low > 1:
        middle = (low + high) // 2
        if len(json.dumps(wide_schema(middle, tag))) <= chars:
            low = middle
        else:
            high = middle
    return low


def schema_bound(mar: Path) -> int:
    """The archive's `max_schema_chars` (its handler section's, else the default)."""
    with zipfile.ZipFile(mar) as archive:
        config = yaml.safe_load(archive.read(archives.CONFIG)) or {}
    handler = config.get("handler") or {}
    return int(handler.get("max_schema_chars", HandlerSettings.max_schema_chars))


def schema_body(schema: dict[str, Any], n: int, max_tokens: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Answer in JSON."}],
                       "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "pressure", "schema": schema}}}).encode()


def post(port: int, path: str, body: bytes, timeout_s: float) -> tuple[int, str]:
    """(status, the start of the body) of one POST; status 0 when the connection failed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()[:200].decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


class SchemaClient:
    """One client that sends a schema request every `every_s`, each on a connection (and a
    thread) of its own; the statuses and latencies of the answers it got."""

    def __init__(self, server: Server, branches: int, args: argparse.Namespace):
        self.server, self.branches, self.args = server, branches, args
        self.stopped = threading.Event()
        self.sent: list[threading.Thread] = []
        self.answers: list[tuple[int, float]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="schema-client")

    def __enter__(self) -> SchemaClient:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()
        for sent in self.sent:
            sent.join(timeout=120)

    def _run(self) -> None:
        period, k = self.args.every_ms / 1000, 0
        next_at = time.monotonic()
        while not self.stopped.is_set():
            tag = "k" if self.args.same_schema else f"k{k % 10**6:06d}_"
            body = schema_body(wide_schema(self.branches, tag), self.args.n,
                               self.args.schema_max_tokens)
            sending = threading.Thread(target=self._send, args=(body,), daemon=True)
            sending.start()
            self.sent.append(sending)
            k += 1
            next_at += period
            self.stopped.wait(max(0.0, next_at - time.monotonic()))

    def _send(self, body: bytes) -> None:
        began = time.perf_counter()
        status, _ = post(self.server.port, self.server.path, body, 120)
        with self.lock:
            self.answers.append((status, 1000 * (time.perf_counter() - began)))


def largest_accepted(server: Server, bound: int, args: argparse.Namespace
                     ) -> tuple[int, int, str]:
    """(branches, characters) of the largest schema the server answers 200 for, and the
    last refusal ("" when the first try was taken): from the archive's bound down, 10% a
    try. UserError when none is taken."""
    tag = "k" if args.same_schema else "k000000_"  # the client's keys have this length
    branches, refusal = branches_within(bound, tag), ""
    while branches >= 1:
        body = schema_body(wide_schema(branches, tag), 1, 1)
        status, text = post(server.port, server.path, body, 300)
        if status == 200:
            return branches, len(json.dumps(wide_schema(branches, tag))), refusal
        refusal = f"{branches} branches: HTTP {status} {text[:120]}"
        branches = int(branches * 0.9)
    raise UserError(f"{server.spec['key']}: no schema was accepted ({refusal})")


def phase(server: Server, args: argparse.Namespace, payloads: list[bytes],
          client: SchemaClient | None) -> dict[str, Any]:
    """The plain requests' figures, sent at once (under the schema client's load)."""
    if client is None:
        return run_chat_load(server.url, args.plain, args.plain, payloads, timeout=300)
    with client:
        time.sleep(SETTLE_S)
        figures = run_chat_load(server.url, args.plain, args.plain, payloads, timeout=300)
    statuses: dict[str, int] = {}
    for status, _ in client.answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    latencies = sorted(ms for status, ms in client.answers if status == 200)
    return {**figures, "schema_statuses": statuses,
            "schema_ms_p50": round(statistics.median(latencies), 1) if latencies else None}


def visit(item: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One engine: started, its largest schema found, the rounds, stopped."""
    payloads = chat_payloads(read_prompts(args.prompts, ()), args.max_tokens, args.plain)

    def load(server: Server, figures: dict[str, Any]) -> None:
        branches, chars, refusal = largest_accepted(server, item["bound"], args)
        figures.update(branches=branches, schema_chars=chars, refused_first=refusal)
        echo(f"schema_pressure: {item['key']}: largest accepted schema {chars} characters "
             f"({branches} branches)")
        run_chat_load(server.url, args.plain, args.plain, payloads, timeout=300)  # warm-up
        figures["alone"], figures["pressure"] = [], []
        for r, kind in alternating(["alone", "pressure"], args.rounds):
            client = SchemaClient(server, branches, args) if kind == "pressure" else None
            got = phase(server, args, payloads, client)
            figures[kind].append(got)
            echo(f"schema_pressure: {item['key']} round {r + 1}: {kind}: TTFT p50 "
                 f"{got['ttft_ms_p50']} ms, {got['errors']} errors"
                 + (f", schema answers {got['schema_statuses']}, p50 "
                    f"{got['schema_ms_p50']} ms" if client else ""))

    return servers.visit(Server(item, work), args.start_timeout, load)


def summary(engine: str, figures: dict[str, Any]) -> dict[str, Any]:
    """One engine's line: TTFT p50 alone and under pressure (min, median, max over the
    rounds) and the ratios by median and by best round."""
    row: dict[str, Any] = {"engine": engine, "schema_chars": figures.get("schema_chars")}
    for kind in ("alone", "pressure"):
        row.update(spread([f["ttft_ms_p50"] for f in figures.get(kind, [])
                           if f["ttft_ms_p50"] is not None], kind))
    if row["alone_median"] and row["pressure_median"]:
        row["ratio_median"] = round(row["pressure_median"] / row["alone_median"], 2)
        row["ratio_best"] = round(row["pressure_min"] / row["alone_min"], 2)
    row["errors"] = sum(f["errors"] for k in ("alone", "pressure") for f in figures.get(k, []))
    return row


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when a server failed, 2 for bad input."""
    args = parse_args(argv)
    return exit_code(lambda: _main(args), user=(UserError, FileNotFoundError))


def _main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="schema_pressure-"))
    echo(f"schema_pressure: server logs in {work}")
    mar = archives.ensure_run(args.run, "llm_int8", args.run.name == "llm_int8"
                              and args.run.suffix != ".mar", echo)
    facts, bound = archives.archive_facts(mar), schema_bound(mar)
    rows, failed = [], False
    for engine in args.engines:
        item = {"key": f"{engine}-{facts['model_name']}", "engine": engine,
                "target": str(args.run), "model_name": facts["model_name"],
                "version": facts["version"], "bound": bound}
        figures = visit(item, args, work)
        if figures.get("error"):
            echo(f"schema_pressure: {engine}: failed: {figures['error']}")
            failed = True
        rows.append({**summary(engine, figures), "figures": figures})
    header = results_header(MODULE, args.argv)
    lines = [*header_lines(header), f"- archive {mar.name}, "
             f"max_schema_chars {bound}; {args.plain} plain requests x {args.max_tokens} "
             f"tokens; schema client every {args.every_ms} ms, n={args.n}, "
             f"{'one text' if args.same_schema else 'a new text each request'}"]
    for row in rows:
        lines.append(
            f"{row['engine']}: schema {row['schema_chars']} chars; TTFT p50 alone "
            f"{row['alone_median']} ms ({row['alone_min']}-{row['alone_max']}), under "
            f"pressure {row['pressure_median']} ms ({row['pressure_min']}-"
            f"{row['pressure_max']}); ratio {row.get('ratio_median')}x by median, "
            f"{row.get('ratio_best')}x by best (target <= {TARGET_RATIO}x); "
            f"{row['errors']} plain errors")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(scrubbed({
            "header": header, "args": {k: str(v) for k, v in vars(args).items()},
            "rows": rows}), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
