"""What a row with a grammar costs the rows beside it, in the served continuous batcher:
decode tok/s of a batch of 8 rows, one of them constrained to a JSON schema (OpenAI's
`response_format: json_schema`, masked by llguidance inside the batched decode), against 8
free rows. SmolLM2-135M-Instruct int8_grouped, in process, with the worker's own decoders
and prefiller (serve/causal_lm), compiled as a worker compiles them:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.micro.structured

Per round (alternating which batch goes first): the aggregate decode tok/s over the first
`--steps` steps where all 8 rows decode, and the time the grammar row's mask and advance
take a token. The constrained answers are checked valid against the schema. Prints a table and, with
`--write`, writes benchmarks/results/llm_structured.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from benchmarks.causal_lm.inputs import MODEL, PROMPTS, SCHEMA
from benchmarks.harness.paths import RESULTS as RESULTS_DIR
from benchmarks.harness.provenance import OURS, header_lines, results_header
from compress.families.causal_lm.model import load_causal_lm, quantize_weights
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.server import grammar
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.buckets import buckets
from serve.causal_lm.server.compiled_graphs import build_decoders, warm_up
from serve.causal_lm.server.prefill import Prefiller

RESULTS = RESULTS_DIR / "llm_structured.md"
class Timed:
    """A constraint whose mask and advance are timed."""

    def __init__(self, inner: grammar.Constraint, spent: list[float]):
        self.inner, self.spent = inner, spent

    def mask(self, logits: torch.Tensor) -> None:
        began = time.perf_counter()
        self.inner.mask(logits)
        self.spent.append(time.perf_counter() - began)

    def advance(self, token: int) -> None:
        began = time.perf_counter()
        self.inner.advance(token)
        self.spent[-1] += time.perf_counter() - began


def run_batch(batcher: ContinuousBatcher, prompts: list[list[int]], new: int,
              constraint: Timed | None, steps_timed: int) -> tuple[float, list[int]]:
    """(aggregate tok/s over the first `steps_timed` steps where all rows decode, the first
    row's tokens)."""
    tokens: list[list[int]] = [[] for _ in prompts]

    def emit(k: int):
        return lambda token, end: tokens[k].append(token) if token is not None else None

    for k, ids in enumerate(prompts):
        batcher.submit(Row(ids, new, emit(k), constraint=constraint if k == 0 else None,
                           ignore_eos=k > 0))
    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        while batcher.busy() < len(prompts):
            batcher.turn()
        began, steps = time.perf_counter(), batcher.steps
        while batcher.busy() == len(prompts) and batcher.steps - steps < steps_timed:
            batcher.turn()
        spent, done = time.perf_counter() - began, batcher.steps - steps
        while not batcher.idle():
            batcher.turn()
    return len(prompts) * done / spent, tokens[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=160, help="tokens a row at most")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed a batch")
    parser.add_argument("--compile", default="default", choices=["none", "default",
                                                                 "max-autotune"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_causal_lm(MODEL)
    quantize_weights(lm.model, "int8_grouped")
    ask = "Describe a film you like as JSON: title, year, genres, rating, summary."
    prompts = [loading.prompt_ids(lm.tokenizer, p) for p in [ask, *PROMPTS[:7]]]
    cache_len = max(len(p) for p in prompts) + args.new + 8
    decoders = build_decoders(lm.model, buckets(8), cache_len, args.compile, False)
    warm_up(decoders, shared=True, log=lambda line: print(line, flush=True))
    prefiller = Prefiller(lm.model, cache_len, compiled=False)
    stop = loading.stop_ids(lm.model, lm.tokenizer)
    json_grammar = grammar.json_grammar(SCHEMA)
    grammar.engine_tokenizer(lm.tokenizer)  # once a worker, not on a request
    rates: dict[str, list[float]] = {"8 free rows": [], "1 json_schema row + 7 free": []}
    spent: list[float] = []
    answers = []
    for r in range(args.rounds + 1):  # round 0 warms up, unrecorded
        for name in (list(rates) if r % 2 else list(rates)[::-1]):
            batcher = ContinuousBatcher(decoders, prefiller, stop, own_thread=False)
            constraint = (Timed(grammar.Constraint(lm.tokenizer, json_grammar), spent)
                          if "json" in name else None)
            rate, first = run_batch(batcher, prompts, args.new, constraint, args.steps)
            if constraint is not None:
                answers.append(lm.tokenizer.decode(first, skip_special_tokens=True))
            if r:
                rates[name].append(rate)
                print(f"round {r} {name}: {rate:.1f} tok/s", flush=True)
    valid = sum(_valid(a) for a in answers)
    free, mixed = (statistics.median(v) for v in rates.values())
    header = results_header("benchmarks.causal_lm.micro.structured",
                            sys.argv[1:] if argv is None else argv,
                            ours=(*OURS, "llguidance", "jsonschema-rs"))
    lines = ["# A json_schema row beside free rows (served continuous batcher)", "",
             *header_lines(header),
             f"- SmolLM2-135M-Instruct int8_grouped, compile {args.compile}, "
             f"{args.threads} threads, {args.rounds} alternating rounds (medians)", "",
             "| batch of 8 | decode tok/s (median) | spread |", "|---|---|---|"]
    for name, values in rates.items():
        lines.append(f"| {name} | {statistics.median(values):.1f} | "
                     f"{min(values):.1f}-{max(values):.1f} |")
    lines += ["", f"- ratio mixed / free: **{mixed / free:.3f}** (the target: at least 0.90)",
              f"- the grammar row's mask + advance: median {statistics.median(spent) * 1e6:.0f}"
              f" us a token, p99 {sorted(spent)[int(0.99 * (len(spent) - 1))] * 1e6:.0f} us",
              f"- constrained answers valid against the schema: {valid} of {len(answers)}",
              "- its slowest tokens (ms): " + ", ".join(
                  f"{t * 1e3:.1f}" for t in sorted(spent, reverse=True)[:5])]
    print("\n".join(lines))
    if args.write:
        RESULTS.write_text("\n".join(lines) + "\n")
    return 0


def _valid(text: str) -> bool:
    import jsonschema_rs

    try:
        jsonschema_rs.validate(SCHEMA, json.loads(text))
    except (ValueError, jsonschema_rs.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
