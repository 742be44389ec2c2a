"""How many rows one prefill should take: a burst of requests arriving at once at an idle
continuous batcher (the worker's own decoders and prefiller, serve/causal_lm), with the
prefill taking every free row, or at most `--caps` rows a job. In process, on a causal-LM
export folder:

    python -m benchmarks.causal_lm.micro.prefill_rows runs/llm_int8/02-export/transformers

Per cap and burst size: time to first token (median, p99 and mean over the burst's
requests), the burst's tokens per second (every request `--new` tokens, to its last), and
the prefill's workspace (MB: rows x cache_len positions of keys and values), medians over
alternating rounds. Prints a table and writes benchmarks/results/llm_prefill_rows.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.buckets import buckets
from serve.causal_lm.server.compiled_graphs import build_decoders, warm_up
from serve.causal_lm.server.prefill import Prefiller


def burst(batcher: ContinuousBatcher, prompts: list[list[int]], new: int) -> dict[str, float]:
    """Every prompt submitted at once; first-token times and the burst's tokens/s."""
    firsts: dict[int, float] = {}

    def emit(k: int):
        return lambda token, end: firsts.setdefault(k, time.perf_counter()) if token else None

    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        began = time.perf_counter()
        rows = [batcher.submit(Row(ids, new, emit(k), ignore_eos=True))
                for k, ids in enumerate(prompts)]
        while not batcher.idle():
            batcher.turn()
        spent = time.perf_counter() - began
    assert all(r.ended for r in rows) and len(firsts) == len(prompts)
    ttft = sorted(t - began for t in firsts.values())
    return {"ttft_p50_ms": statistics.median(ttft) * 1e3, "ttft_p99_ms": ttft[-1] * 1e3,
            "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
            "tokens_per_s": len(prompts) * new / spent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="EXPORT_DIR",
                        help="a causal-LM export folder")
    parser.add_argument("--caps", default="0,4,2", help="rows a prefill takes (0: every free "
                        "row), comma-separated (0,4,2)")
    parser.add_argument("--bursts", default="8,16", help="requests arriving at once (8,16)")
    parser.add_argument("--new", type=int, default=64, help="tokens each request (64)")
    parser.add_argument("--cache-len", type=int, default=512)
    parser.add_argument("--compile", default="none", choices=["none", "default",
                                                              "max-autotune"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=Path, default=REPO / "recipes/prompts/chat20.txt")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "llm_prefill_rows.md")
    args = parser.parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    sizes = [int(b) for b in args.bursts.split(",")]
    lm = loading.load_folder(args.folder)
    texts = [t for t in args.prompts.read_text().splitlines() if t.strip()]
    prompts = [loading.prompt_ids(lm.tokenizer, t, True) for t in texts]
    decoders = build_decoders(lm.model, buckets(8), args.cache_len, args.compile, False)
    warm_up(decoders, shared=True, log=lambda line: print(line, flush=True))
    prefillers = {cap: Prefiller(lm.model, args.cache_len, compiled=args.compile != "none",
                                 max_rows=cap or None) for cap in caps}
    for prefiller in prefillers.values():
        prefiller.warm_up()
    results: dict[tuple[int, int], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for cap in (caps if r % 2 == 0 else caps[::-1]):
            for size in sizes:
                batcher = ContinuousBatcher(decoders, prefillers[cap], set(), own_thread=False)
                got = burst(batcher, [prompts[k % len(prompts)] for k in range(size)],
                            args.new)
                results.setdefault((cap, size), []).append(got)
                print(f"cap {cap or 'all'} burst {size}:",
                      {k: round(v, 1) for k, v in got.items()}, flush=True)
    header = results_header("benchmarks.causal_lm.micro.prefill_rows",
                            sys.argv[1:] if argv is None else argv)
    lines = ["# How many rows one prefill takes: a burst arriving at an idle batcher", "",
             *header_lines(header),
             f"- {args.folder.name}: 8 decode rows, cache_len {args.cache_len}, compile "
             f"{args.compile}, {args.new} new tokens a request, prompts from "
             f"{args.prompts.name} (chat template), {args.rounds} alternating rounds "
             f"(medians)", f"- threads: {torch.get_num_threads()}", "",
             "| rows a prefill takes | burst | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | "
             "tok/s | workspace MB |", "|---|---|---|---|---|---|---|"]
    for (cap, size), runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        workspace = prefillers[cap].cache_bytes() / 2**20
        lines.append(f"| {cap or 'every free row'} | {size} | {med['ttft_p50_ms']:.0f} | "
                     f"{med['ttft_p99_ms']:.0f} | {med['ttft_mean_ms']:.0f} | "
                     f"{med['tokens_per_s']:.1f} | {workspace:.0f} |")
    print("\n".join(lines))
    args.markdown.write_text(scrubbed("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
