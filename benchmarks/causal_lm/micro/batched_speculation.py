"""Speculation inside the continuous batch against the same batch without it, in process,
on a served archive (its shipped decode steps and prefill; speculation's verification
package exported once into `--work` where the archive ships none): closed-loop clients at
each concurrency, each sending its next prompt when its answer ends, over the chat prompts
of `benchmarks/causal_lm/inputs.py` and an extractive set (quote a review given in the
prompt: `micro/speculative.extractive_prompts`). Three modes alternate round by round:
`off` (plain steps), `planned` (what ships: each step speculates where the measured step
times and the rows' acceptance say it pays) and `always` (every step with a draft found
verifies `--drafts`, to show what the plan saves). The step times a plan goes by are kept
from set to set, as a worker's one batcher keeps them, after an untimed pass at each
concurrency. Per set, concurrency and mode: tok/s
(every answer's tokens over the set's wall time; medians and spreads), x off, the drafts
kept, the steps that verified, and whether every answer equals its `off` answer.

    python -m benchmarks.causal_lm.micro.batched_speculation \\
        runs/llm_int4/03-package/llm_int4.mar \\
        --concurrency 1,2,4,8 --rounds 3 --write
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
import zipfile
from pathlib import Path

import torch
import yaml

from benchmarks.causal_lm.inputs import PROMPTS
from benchmarks.causal_lm.micro.speculative import extractive_prompts
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.provenance import header_text, scrubbed
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.server import aot_steps, compiled_graphs, prefill
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.buckets import buckets
from serve.causal_lm.server.speculation import verifier
from serve.handler_settings import HandlerSettings

MODES = ("off", "planned", "always")
CACHE = Path.home() / ".cache" / "compress" / "batched_speculation"


class Always(ContinuousBatcher):
    """Every step with a draft found verifies the most drafts (no cost plan)."""

    def _cost(self, size: int, k: int) -> float:
        return 1.0 / (1 + k)  # more drafts always look cheaper per token


def unpacked(archive: Path, work: Path) -> Path:
    """The archive's files in a folder of `work` named by its contents' hash."""
    if archive.is_dir():
        return archive
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    folder = work / f"{archive.stem}-{digest}"
    if not (folder / "model-config.yaml").is_file():
        with zipfile.ZipFile(archive) as mar:
            mar.extractall(folder)
    return folder


def serve_set(batcher: ContinuousBatcher, prompts: list[list[int]], clients: int,
              new: int) -> tuple[float, list[list[int]]]:
    """(tok/s over the set's wall time, each prompt's answer), `clients` closed-loop."""
    answers: list[list[int]] = [[] for _ in prompts]
    ended: list[int] = []
    order = iter(range(len(prompts)))

    def send(index: int) -> None:
        def emit(token: int | None, end: str | None) -> None:
            if token is not None:
                answers[index].append(token)
            else:
                ended.append(index)
        batcher.submit(Row(prompts[index], new, emit))

    largest = batcher.decoders[batcher.rows]
    with torch.inference_mode(), attention(largest.model, largest.attention):
        began = time.perf_counter()
        for _ in range(clients):
            index = next(order, None)
            if index is not None:
                send(index)
        while not batcher.idle():
            batcher.turn()
            while ended:
                ended.pop()
                index = next(order, None)
                if index is not None:
                    send(index)
        spent = time.perf_counter() - began
    return sum(len(a) for a in answers) / spent, answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path, help="a causal-LM .mar (or its unpacked folder)")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--drafts", type=int, default=4, help="the most drafts a row verifies")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=64, help="new tokens a request at most")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a set")
    parser.add_argument("--work", type=Path, default=CACHE, help="where the archive is "
                        "unpacked and the verification exported")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "llm_batched_speculation.md",
                        help="where --write puts the table")
    parser.add_argument("--write", action="store_true", help="write the table (--markdown)")
    args = parser.parse_args(argv)
    folder = unpacked(args.archive, args.work)
    settings = HandlerSettings.from_config(yaml.safe_load(
        (folder / "model-config.yaml").read_text())["handler"])
    if settings.threads:
        torch.set_num_threads(settings.threads)
    graphs = folder / compiled_graphs.FOLDER
    lm = loading.load_folder(folder)
    if not (graphs / aot_steps.VERIFY).is_file():
        began = time.perf_counter()
        aot_steps.export_verify(lm.model, settings.rows_of(1), settings.cache_len,
                                args.drafts, settings.compile, graphs)
        print(f"verification exported in {time.perf_counter() - began:.0f} s", flush=True)
    steps, shipped_prefill, said = compiled_graphs.use_shipped(graphs, lm.model, settings)
    packages = compiled_graphs.use_shipped_verify(graphs, lm.model)
    print(said, "and the verification" if packages else "(verifying eagerly)", flush=True)
    rows = settings.rows_of(1)
    decoders = compiled_graphs.build_decoders(lm.model, buckets(rows), settings.cache_len,
                                              settings.compile, settings.cpp_wrapper, None,
                                              steps)
    compiled_graphs.warm_up(decoders, shared=True)
    prefiller = prefill.prefiller_of(lm.model, settings, settings.cache_len, shipped_prefill)
    prefiller.warm_up()
    verify = verifier(lm.model, decoders, args.drafts, packages)
    stop = loading.stop_ids(lm.model, lm.tokenizer)
    sets = {"extractive": extractive_prompts(args.prompts), "chat": PROMPTS[:args.prompts]}
    ids = {name: [loading.prompt_ids(lm.tokenizer, t, True) for t in texts]
           for name, texts in sets.items()}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    # one table of measured step times a mode, kept from batcher to batcher (a worker has
    # one batcher for its life), filled by an untimed pass at each concurrency first
    tables: dict[str, dict] = {mode: {} for mode in MODES}

    def batcher_for(mode: str) -> ContinuousBatcher:
        kind = Always if mode == "always" else ContinuousBatcher
        made = kind(decoders, prefiller, stop, own_thread=False,
                    speculate=0 if mode == "off" else args.drafts, verify=verify)
        made.step_cost = tables[mode]
        return made

    for clients in concurrency:
        for mode in MODES:
            serve_set(batcher_for(mode), ids["chat"][:clients] * 2, clients, args.new)
    rates: dict[tuple[str, int, str], list[float]] = {}
    stats: dict[tuple[str, int, str], list[float]] = {}
    same: dict[tuple[str, int, str], bool] = {}
    for r in range(args.rounds):
        for name, prompts in ids.items():
            for clients in concurrency:
                answers = {}
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    batcher = batcher_for(mode)
                    rate, answers[mode] = serve_set(batcher, prompts, clients, args.new)
                    key = (name, clients, mode)
                    rates.setdefault(key, []).append(rate)
                    kept = batcher.accepted / batcher.drafted if batcher.drafted else 0.0
                    share = batcher.verifications / max(batcher.steps, 1)
                    stats[key] = [kept, share]
                    print(f"round {r + 1} {name} c{clients} {mode}: {rate:.1f} tok/s, drafts "
                          f"kept {kept:.2f}, steps verifying {share:.2f}", flush=True)
                for mode in MODES:
                    key = (name, clients, mode)
                    same[key] = same.get(key, True) and answers[mode] == answers["off"]
    lines = ["| set | clients | mode | tok/s (min-max) | x off | drafts kept (last round) | "
             "steps verifying (last round) | answers = off |", "|---|---|---|---|---|---|---|---|"]
    for (name, clients, mode), got in rates.items():
        off = rates[name, clients, "off"]
        ratio = statistics.median(a / b for a, b in zip(got, off, strict=True))
        kept, share = stats[name, clients, mode]
        lines.append(f"| {name} | {clients} | {mode} | {statistics.median(got):.1f} "
                     f"({min(got):.1f}-{max(got):.1f}) | {ratio:.2f} | {kept:.2f} | "
                     f"{share:.2f} | {'yes' if same[name, clients, mode] else 'NO'} |")
    print("\n".join(lines))
    if args.write:
        text = ["# Speculation inside the continuous batch: prompt-lookup drafts verified "
                "together", "", header_text("benchmarks.causal_lm.micro.batched_speculation",
                                            argv),
                f"- {args.archive.name}: {settings.rows_of(1)} rows, cache_len "
                f"{settings.cache_len}, compile {settings.compile}, up to {args.drafts} "
                f"drafts a row, {args.new} new tokens at most (stop tokens end an answer), "
                f"{args.prompts} prompts a set, {args.rounds} rounds alternating the modes' "
                f"order (medians; x off: the median of each round's ratio)",
                f"- threads: {torch.get_num_threads()}; {said}"
                f"{', verification shipped' if packages else ', verifying eagerly'}", "",
                *lines]
        args.markdown.write_text(scrubbed("\n".join(text) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
