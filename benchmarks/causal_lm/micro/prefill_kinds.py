"""Which prefill a served archive should run: eager, or compiled ahead of time (the
AOTInductor package the package stage ships beside the decode steps, `prefill_compile`),
on chat prompts, one prompt a prefill and 8 at once, in process, on a causal-LM export
folder:

    python -m benchmarks.causal_lm.micro.prefill_kinds runs/llm_int8/02-export/transformers \
        --package runs/llm_int8/03-package/.archive_code/compiled_graphs

`--package`: a folder holding the prefill's package (an archive's `compiled_graphs/`);
without it the package is exported into `--out` first (minutes). Per kind and rows: the
prefill's milliseconds (the whole prompt in one chunk, as the batcher runs a lone
request's; median and spread over every prefill of alternating rounds), and for the eager
prefill the share of its time in the grouped products (`compress_lm::grouped_mm`, from
torch.profiler): where a prefill's time goes. Prints a table and writes
benchmarks/results/llm_prefill_kinds.md.
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
from serve.causal_lm.runtime.attention import attention, decode_attention_for
from serve.causal_lm.server import aot_steps
from serve.causal_lm.server.prefill import Prefiller, last_only
from serve.causal_lm.server.rows import Row


def prefill_ms(prefiller: Prefiller, batch: list[list[int]]) -> float:
    """Milliseconds of one prefill of `batch`, whole (the logits' argmax included)."""
    job = prefiller.start([Row(list(ids), 1, lambda token, end: None) for ids in batch])
    began = time.perf_counter()
    prefiller.step(job, whole=True)
    job.logits.argmax(-1).tolist()
    return (time.perf_counter() - began) * 1e3


def grouped_share(prefiller: Prefiller, prompts: list[list[int]]) -> float:
    """The share of one-prompt prefills' CPU time spent in the grouped products."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in prompts[:5]:
            prefill_ms(prefiller, [ids])
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    grouped = sum(e.self_cpu_time_total for e in events if "grouped_mm" in e.key)
    return grouped / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, metavar="EXPORT_DIR",
                        help="a causal-LM export folder")
    parser.add_argument("--package", type=Path, help="a folder with the prefill's package")
    parser.add_argument("--out", type=Path, default=Path("runs/prefill_package"),
                        help="where the package is exported without --package")
    parser.add_argument("--rows", default="1,8", help="prompts a prefill, comma-separated")
    parser.add_argument("--cache-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=Path, default=REPO / "recipes/prompts/chat20.txt")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "llm_prefill_kinds.md")
    args = parser.parse_args(argv)
    sizes = [int(r) for r in args.rows.split(",")]
    lm = loading.load_folder(args.folder)
    texts = [t for t in args.prompts.read_text().splitlines() if t.strip()]
    prompts = [loading.prompt_ids(lm.tokenizer, t, True) for t in texts]
    folder = args.package
    if folder is None:
        folder = args.out
        if not (folder / aot_steps.PREFILL).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            print(f"exporting the prefill for {max(sizes)} rows ...", flush=True)
            aot_steps.export_prefill(lm.model, max(sizes), args.cache_len, "default", folder,
                                     last_only(lm.model))
    packages = aot_steps.load_prefill(folder, lm.model)
    if not packages:
        raise SystemExit(f"llm_prefill_kinds: no {aot_steps.PREFILL} in {folder}")
    prefillers = {
        "eager": Prefiller(lm.model, args.cache_len, last_only=last_only(lm.model)),
        "ahead of time": Prefiller(lm.model, args.cache_len, last_only=last_only(lm.model),
                                   package=aot_steps.LoadedPrefill(
                                       packages, max(sizes), last_only(lm.model)))}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode(), attention(lm.model, decode_attention_for(lm.model)):
        for prefiller in prefillers.values():
            prefiller.warm_up()
        share = grouped_share(prefillers["eager"], prompts)
        kinds = list(prefillers)
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                for rows in sizes:
                    for k in range(0, len(prompts) - rows + 1, rows):
                        times.setdefault((kind, rows), []).append(
                            prefill_ms(prefillers[kind], prompts[k:k + rows]))
                print(f"round {r + 1}: {kind} done", flush=True)
    lengths = sorted(len(p) for p in prompts)
    header = results_header("benchmarks.causal_lm.micro.prefill_kinds",
                            sys.argv[1:] if argv is None else argv)
    lines = ["# The served prefill: eager against compiled ahead of time", "",
             *header_lines(header),
             f"- {args.folder.name}: cache_len {args.cache_len}, prompts from "
             f"{args.prompts.name} (chat template, {lengths[0]}-{lengths[-1]} tokens, the "
             f"whole prompt one chunk, no prefix cache), {args.rounds} alternating rounds",
             f"- threads: {torch.get_num_threads()}",
             f"- the eager one-prompt prefill's CPU time in the grouped products: "
             f"{100 * share:.0f}%", "",
             "| prefill | prompts a prefill | ms median | ms min | ms max | x eager |",
             "|---|---|---|---|---|---|"]
    for (kind, rows), spent in times.items():
        eager = statistics.median(times[("eager", rows)])
        lines.append(f"| {kind} | {rows} | {statistics.median(spent):.1f} | {min(spent):.1f} "
                     f"| {max(spent):.1f} | {statistics.median(spent) / eager:.2f} |")
    print("\n".join(lines))
    args.markdown.write_text(scrubbed("\n".join(lines) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
