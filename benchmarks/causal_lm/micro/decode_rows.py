"""How many rows the continuous batcher should decode together: 8, 16 or 32 rows under a
closed-loop load of 16 and 32 clients (each sends its next request when its answer ends),
in process, on a causal-LM export folder, with the worker's own decoders (one graph for
every bucket of 2 rows or more: the dynamic-rows step) and prefiller (the handler's default
settings: the prefix cache on, which reuses the chat template's system prompt; eager,
where an archive ships it compiled ahead of time):

    python -m benchmarks.causal_lm.micro.decode_rows runs/llm_int8/02-export/transformers

Per rows and clients: tokens per second over the load (every request `--new` tokens),
time to first token (median and p99, from a request's submission) and a running row's
inter-token gap (median and p99), medians over alternating rounds. Past the rows, requests
wait for a free row: more rows bound that wait where a step of more rows costs less than
the answers it lets start. Each rows setting runs in a process of its own, its rounds one
after another (several compiled row counts in one process share Dynamo's recompile limit:
measured together, the first built fell back to slower graphs). Prints a table and writes
benchmarks/results/llm_decode_rows.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.causal_lm.micro.chunked_prefill import percentile
from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.buckets import buckets
from serve.causal_lm.server.compiled_graphs import build_decoders, warm_up
from serve.causal_lm.server.prefill import prefiller_of
from serve.handler_settings import HandlerSettings


def closed_loop(batcher: ContinuousBatcher, prompts: list[list[int]], clients: int,
                requests: int, new: int) -> dict[str, float]:
    """`clients` clients, `requests` requests in all; each client's next request is
    submitted as its answer ends."""
    sent: list[float] = []
    firsts: dict[int, float] = {}
    gaps: list[float] = []
    last: dict[int, float] = {}

    def submit() -> None:
        k = len(sent)
        sent.append(time.perf_counter())

        def on_token(token: int | None, end: str | None) -> None:
            now = time.perf_counter()
            if token is not None:
                if k in last:
                    gaps.append(now - last[k])
                firsts.setdefault(k, now)
                last[k] = now
            elif len(sent) < requests:
                submit()

        batcher.submit(Row(prompts[k % len(prompts)], new, on_token, ignore_eos=True))

    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        began = time.perf_counter()
        for _ in range(min(clients, requests)):
            submit()
        while not batcher.idle():
            batcher.turn()
        spent = time.perf_counter() - began
    ttft = [firsts[k] - sent[k] for k in range(len(sent))]
    return {"tokens_per_s": len(sent) * new / spent,
            "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "itl_p50_ms": statistics.median(gaps) * 1e3,
            "itl_p99_ms": percentile(gaps, 99) * 1e3}


def measure_rows(args: argparse.Namespace, rows: int, levels: list[int]
                 ) -> dict[str, list[dict[str, float]]]:
    """`args.rounds` rounds of every level at `rows` decode rows, in this process: by
    clients, each round's figures."""
    lm = loading.load_folder(args.folder)
    texts = [t for t in args.prompts.read_text().splitlines() if t.strip()]
    prompts = [loading.prompt_ids(lm.tokenizer, t, True) for t in texts]
    began = time.perf_counter()
    decoders = build_decoders(lm.model, buckets(rows), args.cache_len, args.compile, True)
    warm_up(decoders, shared=True, log=lambda line: None)
    prefiller = prefiller_of(lm.model, HandlerSettings(), args.cache_len)
    prefiller.warm_up()
    print(f"{rows} rows: built in {time.perf_counter() - began:.0f} s", file=sys.stderr,
          flush=True)
    found: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for clients in (levels if r % 2 == 0 else levels[::-1]):
            batcher = ContinuousBatcher(decoders, prefiller, set(), own_thread=False,
                                        max_waiting=4 * max(levels))
            got = closed_loop(batcher, prompts, clients, args.requests * clients, args.new)
            found.setdefault(str(clients), []).append(got)
            print(f"{rows} rows, {clients} clients:",
                  {k: round(v, 1) for k, v in got.items()}, file=sys.stderr, flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="EXPORT_DIR",
                        help="a causal-LM export folder")
    parser.add_argument("--rows", default="8,16,32", help="decode rows, comma-separated")
    parser.add_argument("--clients", default="16,32", help="concurrent clients")
    parser.add_argument("--requests", type=int, default=3,
                        help="requests a level, in multiples of its clients (3)")
    parser.add_argument("--new", type=int, default=64, help="tokens each request (64)")
    parser.add_argument("--cache-len", type=int, default=512)
    parser.add_argument("--compile", default="default", choices=["none", "default",
                                                                 "max-autotune"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=REPO / "recipes/prompts/chat20.txt")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "llm_decode_rows.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(r) for r in args.rows.split(",")]
    levels = [int(c) for c in args.clients.split(",")]
    if args.child:
        print(json.dumps(measure_rows(args, sizes[0], levels)), flush=True)
        return 0
    results: dict[tuple[int, int], list[dict[str, float]]] = {}
    for rows in sizes:  # a process each: see the module's docstring
        child = [sys.executable, "-m", "benchmarks.causal_lm.micro.decode_rows",
                 str(args.folder), "--rows", str(rows), "--clients", args.clients,
                 "--requests", str(args.requests), "--new", str(args.new), "--cache-len",
                 str(args.cache_len), "--compile", args.compile, "--rounds", str(args.rounds),
                 "--prompts", str(args.prompts), "--child"]
        done = subprocess.run(child, stdout=subprocess.PIPE, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"llm_decode_rows: {rows} rows failed (exit {done.returncode})")
        for clients, runs in json.loads(done.stdout.strip().splitlines()[-1]).items():
            results[(rows, int(clients))] = runs
    header = results_header("benchmarks.causal_lm.micro.decode_rows",
                            sys.argv[1:] if argv is None else argv)
    lines = ["# How many rows to decode together: closed-loop clients on the served batcher",
             "", *header_lines(header),
             f"- {args.folder.name}: cache_len {args.cache_len}, compile {args.compile} "
             f"(dynamic rows), eager prefill, {args.new} new tokens a request, "
             f"{args.requests} x clients requests a level, prompts from {args.prompts.name} "
             f"(chat template), {args.rounds} rounds (medians), each rows setting in a "
             f"process of its own", f"- threads: {torch.get_num_threads()}", "",
             "| rows | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms |", "|---|---|---|---|---|---|---|"]
    for (rows, clients), runs in sorted(results.items()):
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        lines.append(f"| {rows} | {clients} | {med['tokens_per_s']:.1f} | "
                     f"{med['ttft_p50_ms']:.0f} | {med['ttft_p99_ms']:.0f} | "
                     f"{med['itl_p50_ms']:.1f} | {med['itl_p99_ms']:.1f} |")
    print("\n".join(lines))
    args.markdown.write_text(scrubbed("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
