"""Whether a served decode step lets the worker's other Python threads run: an archive's
shipped decode steps loaded both ways (`aot_steps.OperatorLoader`, the kernel library's
operators, and torch._C._aoti's binding), each run in a loop at `--rows` rows while a
second thread sleeps 1 ms at a time, as an engine's event loop waits for its sockets. Per
loader, alternating rounds: the step's time alone and beside that thread, and how late it
wakes (median, p99 and max over every wake-up; a thread that waits for the GIL wakes when
the step ends).

    python -m benchmarks.causal_lm.micro.package_gil runs/llm_int4/03-package/llm_int4.mar \\
        --rows 1,8 --rounds 4 --write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from benchmarks.causal_lm.micro.batched_speculation import CACHE, unpacked
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.provenance import header_text, scrubbed
from benchmarks.harness.rounds import alternating
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.attention import attention
from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.server import aot_steps, compiled_graphs
from serve.handler_settings import HandlerSettings

LOADERS = ("operators", "binding")


def loaded_both_ways(graphs: Path, model: torch.nn.Module) -> dict[str, dict[int, object]]:
    """The shipped steps through the kernel library's operators and through the binding."""
    through_operators = aot_steps.load_steps(graphs, model)
    if not aot_steps.operators_loaded():
        raise SystemExit("the kernel library's package operators are not loaded: the archive's "
                         "model is not on compress's kernels")
    held = aot_steps.operators_loaded
    aot_steps.operators_loaded = lambda: False
    try:
        through_binding = aot_steps.load_steps(graphs, model)
    finally:
        aot_steps.operators_loaded = held
    return {"operators": through_operators, "binding": through_binding}


def run(decoder: StaticDecoder, rows: int, steps: int, beside: bool = True
        ) -> tuple[float, list[float]]:
    """(a step's mean ms, every wake-up's lateness in ms of a thread sleeping 1 ms beside
    the steps; `beside` False: no such thread)."""
    late: list[float] = []
    running = True

    def sleeper() -> None:
        while running:
            began = time.perf_counter()
            time.sleep(0.001)
            late.append((time.perf_counter() - began) * 1e3 - 1.0)

    tokens, positions = torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), 100)
    mask = torch.ones(rows, decoder.max_cache_len, dtype=torch.long)
    thread = threading.Thread(target=sleeper)
    if beside:
        thread.start()
    began = time.perf_counter()
    for _ in range(steps):
        decoder.decode_step(tokens, 100, positions, mask, first=False)
    spent = (time.perf_counter() - began) / steps * 1e3
    running = False
    if beside:
        thread.join()
    return spent, late


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path, help="a causal-LM .mar (or its unpacked folder)")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--work", type=Path, default=CACHE, help="where the archive is unpacked")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "llm_package_gil.md")
    parser.add_argument("--write", action="store_true", help="write the table (--markdown)")
    args = parser.parse_args(argv)
    folder = unpacked(args.archive, args.work)
    settings = HandlerSettings.from_config(
        yaml.safe_load((folder / "model-config.yaml").read_text())["handler"])
    if settings.threads:
        torch.set_num_threads(settings.threads)
    lm = loading.load_folder(folder)
    packages = loaded_both_ways(folder / compiled_graphs.FOLDER, lm.model)
    times: dict[tuple[int, str], list[float]] = {}
    quiet: dict[tuple[int, str], list[float]] = {}
    lateness: dict[tuple[int, str], list[float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        decoders = {}
        for name in LOADERS:
            decoder = StaticDecoder(lm.model, settings.cache_len, always_mask=True)
            decoders[name] = aot_steps.use_step(decoder, packages[name][min(rows, 2)])
            decoders[name].allocate(rows, dynamic_rows=rows > 1)
        with torch.inference_mode(), attention(lm.model, decoders["operators"].attention):
            for r, name in alternating(list(LOADERS), args.rounds):
                run(decoders[name], rows, 3)  # warm
                quiet.setdefault((rows, name), []).append(
                    run(decoders[name], rows, args.steps, beside=False)[0])
                spent, late = run(decoders[name], rows, args.steps)
                times.setdefault((rows, name), []).append(spent)
                lateness.setdefault((rows, name), []).extend(late)
                print(f"round {r + 1} rows {rows} {name}: step alone "
                      f"{quiet[rows, name][-1]:.2f} ms, beside the thread {spent:.2f} ms, "
                      f"wake-up late p50 {statistics.median(late):.2f} ms", flush=True)
    lines = ["| rows | loader | step ms alone (min-max) | step ms beside the thread | "
             "wake-ups | late p50 ms | late p99 ms | late max ms |",
             "|---|---|---|---|---|---|---|---|"]
    for (rows, name), spent in times.items():
        late, alone = sorted(lateness[rows, name]), quiet[rows, name]
        lines.append(f"| {rows} | {name} | {statistics.median(alone):.2f} ({min(alone):.2f}-"
                     f"{max(alone):.2f}) | {statistics.median(spent):.2f} | {len(late)} | "
                     f"{statistics.median(late):.2f} | "
                     f"{late[int(0.99 * (len(late) - 1))]:.2f} | {late[-1]:.2f} |")
    print("\n".join(lines))
    if args.write:
        text = ["# A shipped decode step and the worker's other threads: operators against "
                "the binding", "", header_text("benchmarks.causal_lm.micro.package_gil", argv),
                f"- {args.archive.name}: cache_len {settings.cache_len}, {args.steps} steps a "
                f"round, {args.rounds} rounds alternating the loaders (step: the median of "
                f"the rounds' means; wake-ups: every one of a thread sleeping 1 ms, how much "
                f"later than 1 ms it woke)", f"- threads: {torch.get_num_threads()}", "",
                *lines]
        args.markdown.write_text(scrubbed("\n".join(text) + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
