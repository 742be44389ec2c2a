"""A long prompt joining running streams, in the served continuous batcher: the running
rows' inter-token latency while a 1,000-token prompt is prefilled beside them: in chunks
sized to a decode step's time (the default, at most `prefill_chunk` positions), in fixed
chunks of `prefill_chunk` positions, and whole (one chunk, as before issue 41). In
process, on a causal-LM export folder, with the worker's own decoders and prefiller
(serve/causal_lm), compiled as a worker compiles them:

    python -m benchmarks.causal_lm.micro.chunked_prefill runs/llm_int8/02-export/transformers

Seven rows decode `--new` tokens each; after `--settle` steps the long prompt joins. Per
mode: the running rows' inter-token gaps (median, p99, p99/median), the long prompt's time
to first token, and the steps it took. Prints a table and writes
benchmarks/results/llm_chunked_prefill.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.paths import RESULTS
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.buckets import buckets
from serve.causal_lm.server.compiled_graphs import build_decoders, warm_up
from serve.causal_lm.server.prefill import Prefiller


def percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q / 100 * len(ranked) + 0.5) - 1))]


def measure(batcher: ContinuousBatcher, ids: list[int], long: list[int], new: int,
            settle: int) -> dict[str, float]:
    """Seven rows, then the long prompt after `settle` steps; the running rows' gaps."""
    stamps: dict[int, list[float]] = {k: [] for k in range(8)}

    def emit(k: int):
        return lambda token, end: stamps[k].append(time.perf_counter()) if token else None

    rows = [batcher.submit(Row(ids, new, emit(k), ignore_eos=True)) for k in range(7)]
    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        while batcher.busy() < 7 or batcher.steps < settle:
            batcher.turn()
        began, steps = time.perf_counter(), batcher.steps
        batcher.submit(Row(long, 4, emit(7), ignore_eos=True))
        joined = None
        while not batcher.idle():
            batcher.turn()
            if joined is None and stamps[7]:
                joined = batcher.steps - steps
    # the running rows' gaps while the long prompt is prefilled: from its arrival to the
    # first decode step after it joined
    after = [t for k in range(7) for t in stamps[k] if t > stamps[7][0]]
    if not after:
        raise SystemExit("llm_chunked_prefill: the running rows ended before the long prompt "
                         "joined: give them more tokens (--new)")
    until = min(after)
    gaps = [b - a for k in range(7) for a, b in zip(stamps[k], stamps[k][1:], strict=False)
            if began < b <= until]
    before = [b - a for k in range(7) for a, b in zip(stamps[k], stamps[k][1:], strict=False)
              if b <= began]  # undisturbed: the rows alone
    assert all(r.ended for r in rows)
    median = statistics.median(before)
    return {"itl_p50_ms": median * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3, "p99_over_p50": percentile(gaps, 99) / median,
            "long_ttft_s": stamps[7][0] - began, "steps_to_join": joined or 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="EXPORT_DIR",
                        help="a causal-LM export folder")
    parser.add_argument("--long", type=int, default=1000, help="the joining prompt's tokens")
    parser.add_argument("--new", type=int, default=400, help="each running row's tokens")
    parser.add_argument("--settle", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--compile", default="default", choices=["none", "default",
                                                                 "max-autotune"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", type=Path,
                        default=RESULTS / "llm_chunked_prefill.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lm = loading.load_folder(args.folder)
    cache_len = args.long + 64 + args.new
    ids = loading.prompt_ids(lm.tokenizer, "Write a long story about the sea.", True)
    long = (ids * (args.long // len(ids) + 1))[:args.long]
    decoders = build_decoders(lm.model, buckets(8), cache_len, args.compile, False)
    warm_up(decoders, shared=True, log=lambda line: print(line, flush=True))
    prefillers = {mode: Prefiller(lm.model, cache_len, chunk, compiled=args.compile != "none",
                                  budgeted=budgeted)
                  for mode, chunk, budgeted in (("timed", args.chunk, True),
                                                (f"fixed {args.chunk}", args.chunk, False),
                                                ("whole", cache_len, False))}
    for prefiller in prefillers.values():
        prefiller.warm_up()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in prefillers}
    for r in range(args.rounds):
        for mode in (list(prefillers) if r % 2 == 0 else list(prefillers)[::-1]):
            batcher = ContinuousBatcher(decoders, prefillers[mode], set(), own_thread=False)
            results[mode].append(measure(batcher, ids, long, args.new, args.settle))
            print(mode, {k: round(v, 2) for k, v in results[mode][-1].items()}, flush=True)
    header = results_header("benchmarks.causal_lm.micro.chunked_prefill",
                            sys.argv[1:] if argv is None else argv)
    lines = ["# A 1,000-token prompt joining seven running streams (served batcher)", "",
             *header_lines(header),
             f"- compile {args.compile}, chunk {args.chunk}, {args.rounds} rounds (medians)",
             f"- threads: {torch.get_num_threads()}", "",
             "ITL p50: the running rows alone, before the long prompt arrives; p99 and max: "
             "from its arrival to the first decode step after it joined.", "",
             "| prefill | ITL p50 ms | ITL p99 ms | ITL max ms | p99 / p50 | long TTFT s |",
             "|---|---|---|---|---|---|"]
    for mode, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        lines.append(f"| {mode} | {med['itl_p50_ms']:.1f} | {med['itl_p99_ms']:.1f} | "
                     f"{med['itl_max_ms']:.1f} | {med['p99_over_p50']:.2f} | "
                     f"{med['long_ttft_s']:.2f} |")
    print("\n".join(lines))
    args.markdown.write_text(scrubbed("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
