"""One archive served by each engine in turn on this machine: TorchServe, LitServe, and
Ray Serve with 1 and 2 replicas (a local Ray cluster `compress serve` starts), in one
invocation, rounds alternating the engines' order. Each engine, each round: started fresh
(`compress.serving.server.start`, the time to its first answer kept), then `--lone`
requests one at a time (the engine's own cost a request: the proxy hop, the HTTP stack),
then `--requests` at `--concurrency` in flight (`compress loadtest`'s `run_load`): req/s,
p50 and p99, and the CPU every process used over them (where an engine's time goes); then
stopped. Same archive, handler, batch settings and texts for all.

    python -m benchmarks.serving.engines runs/bert_int8 --markdown \\
        benchmarks/results/serving_engines_<cpu>.md

On 2 cores a second Ray replica adds no compute: it splits the same cores (each replica
gets half the archive's threads) and adds a second process's batches; what it shows is the
engine's routing, not a speed-up."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.cli import Parser, echo, exit_code
from benchmarks.harness.process_cpu import cpu_spent, ray_or_named, read_process, reading
from benchmarks.harness.provenance import results_header, scrubbed, shown
from benchmarks.serving.table import compare, engine_row, markdown
from compress.errors import UserError
from compress.serving import server
from compress.serving.loadtest.predictions import SAMPLE_TEXTS, read_texts, run_load
from compress.serving.ray.options import RayOptions

ENGINES = "torchserve,litserve,ray:1,ray:2"
TOP_PROCESSES = 3  # the kinds of process a row names with their CPU a request
START_TIMEOUT_S = 300


def parse_engines(text: str) -> list[tuple[str, str, int | None]]:
    """`torchserve,litserve,ray:2` as (name, engine, Ray replicas or None)."""
    found = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        engine, _, replicas = part.partition(":")
        if engine not in server.ENGINES or (replicas and engine != "ray"):
            raise UserError(f"--engines {part!r}: expected torchserve, litserve or "
                            f"ray:REPLICAS")
        if engine == "ray":
            if not replicas.isdigit() or int(replicas) < 1:
                raise UserError(f"--engines {part!r}: expected ray:REPLICAS, e.g. ray:2")
            found.append((f"ray {replicas} replica{'s' * (int(replicas) > 1)}", engine,
                          int(replicas)))
        else:
            found.append((engine, engine, None))
    if not found:
        raise UserError("--engines: give at least one engine")
    return found


def one_round(target: Path, engine: str, replicas: int | None, port: int,
              bodies: list[bytes], args: Any) -> dict[str, Any]:
    """One engine served, loaded and stopped: its round's figures, or {"error": line}."""
    resolved = server.resolve_target(target)
    began = time.monotonic()
    try:
        info = server.start(resolved, port=port, timeout_s=START_TIMEOUT_S,
                            echo=lambda _: None, engine=engine,
                            ray=RayOptions(replicas=replicas) if replicas else None)
    except Exception as exc:  # noqa: BLE001 - a failed engine is a row's error
        server.stop(resolved.serve_dir)
        return {"error": str(exc).splitlines()[0][:300]}
    try:
        start_s = time.monotonic() - began
        headers = {"Authorization": f"Bearer {info['token']}"} if info.get("token") else None
        lone = run_load(info["url"], 1, args.lone, bodies, headers=headers,
                        warmup=args.warmup)
        run_load(info["url"], args.concurrency, args.warmup, bodies, headers=headers)
        before = reading()
        loaded = run_load(info["url"], args.concurrency, args.requests, bodies,
                          headers=headers)
        spent = cpu_spent(before, reading())
    finally:
        server.stop(resolved.serve_dir)
    own = read_process(str(os.getpid()))
    client = spent.pop(ray_or_named(own), 0.0) if own else 0.0
    per_request = {kind: 1000 * seconds / args.requests for kind, seconds in spent.items()}
    return {"rps": loaded["throughput_rps"], "p50_ms": loaded["latency_ms_p50"],
            "p99_ms": loaded["latency_ms_p99"], "lone_p50_ms": lone["latency_ms_p50"],
            "start_s": round(start_s, 2), "errors": loaded["errors"] + lone["errors"],
            "batch_mean": loaded["batch_size_mean"],
            "cpu_ms": round(sum(per_request.values()), 3),
            "client_cpu_ms": round(1000 * client / args.requests, 3),
            "cpu_where": ", ".join(f"{kind} {ms:.1f}" for kind, ms in
                                   list(per_request.items())[:TOP_PROCESSES])}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m benchmarks.serving.engines", description=__doc__)
    parser.add_argument("target", type=Path, help="a run folder with a package stage, or a "
                        ".mar (served as it is packaged)")
    parser.add_argument("--engines", default=ENGINES, help=f"default {ENGINES}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=800,
                        help="requests a round at --concurrency (default 800)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lone", type=int, default=100,
                        help="requests a round one at a time (default 100)")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--texts", help="a file of texts, one a line (default: "
                        "`compress loadtest`'s sample texts)")
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--markdown", type=Path, help="write the table here (and a .json "
                        "beside it)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.lone < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests, --lone and --concurrency take positive numbers")

    def body() -> int:
        engines = parse_engines(args.engines)
        if not args.target.exists():
            raise UserError(f"{args.target}: no such run folder or archive")
        texts = read_texts(args.texts) if args.texts else SAMPLE_TEXTS
        bodies = [json.dumps({"text": t}).encode() for t in texts]
        header = results_header("benchmarks.serving.engines", argv,
                                ours=("torch", "onnxruntime", "torchserve", "litserve",
                                      "ray"))
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in engines}
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            for name, engine, replicas in order:
                echo(f"round {r + 1}/{args.rounds}: {name}")
                figures = one_round(args.target, engine, replicas, args.port, bodies, args)
                echo(f"  {figures}")
                rounds[name].append(figures)
        rows = compare([engine_row(name, rounds[name]) for name, *_ in engines])
        setup = [f"- archive: `{shown(args.target)}`, served as packaged (its batch size, "
                 f"delay, workers and threads); {len(texts)} texts cycled",
                 f"- each engine, each round: started fresh, {args.warmup} warm-up requests, "
                 f"{args.lone} requests one at a time (c1 p50), then {args.requests} at "
                 f"concurrency {args.concurrency} (after {args.warmup} more at that "
                 f"concurrency); {args.rounds} rounds, the engines' order reversed every other "
                 f"round; medians over rounds, req/s min-max",
                 "- server CPU ms/req: the CPU time of every process of the machine but the "
                 "load generator's over the loaded requests, per request (/proc's utime + "
                 "stime); load generator: this benchmark's own (its client threads share the "
                 "cores); by process: the first round's three largest kinds, ms a request",
                 "- Ray Serve: a local cluster `compress serve --engine ray` starts (one node, "
                 "its proxy on the head); 2 replicas split the archive's threads"]
        text = markdown(rows, header, setup)
        print(text)
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text)
            args.markdown.with_suffix(".json").write_text(json.dumps(
                scrubbed({"header": header, "rows": rows}), indent=1) + "\n")
            echo(f"written: {shown(args.markdown)}")
        return 1 if any(row.get("error") for row in rows) else 0

    return exit_code(body)


if __name__ == "__main__":
    sys.exit(main())
