"""The floor under a served causal LM's cold start: what a fresh Python process takes to
import what a worker needs before it loads a byte of the model, each in a process of its
own, alternated round by round (the median and the spread over the rounds).

    python -m benchmarks.causal_lm.micro.import_floor --rounds 5 --markdown out.md

A LitServe worker is a spawned process (LitServe starts its inference workers with
`spawn`): it imports torch itself, after the server process has imported LitServe; the
shipped worker then imports transformers' Llama for the model's skeleton and its static
cache. A cold start can be no shorter than the first two in sequence.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.provenance import header_text

STEPS = {  # name: code run in a fresh interpreter
    "python alone": "pass",
    "import litserve": "import litserve",
    "import torch": "import torch",
    "import torch, transformers' Llama": (
        "import sys, torch\n"
        "for name in ('scipy', 'accelerate', 'torchao'): sys.modules[name] = None\n"
        "from transformers.models.llama import modeling_llama"),
}


def timed(code: str) -> float:
    """Seconds a fresh interpreter takes to run `code` and exit."""
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    seen: dict[str, list[float]] = {name: [] for name in STEPS}
    for _ in range(args.rounds):
        for name, code in STEPS.items():
            seen[name].append(timed(code))
    lines = [header_text("benchmarks.causal_lm.micro.import_floor", argv or sys.argv[1:]), "",
             f"| fresh process | s (median of {args.rounds}) | min | max |",
             "|---|---:|---:|---:|"]
    for name, times in seen.items():
        lines.append(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | "
                     f"{max(times):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
