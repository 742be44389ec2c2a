"""One fresh process of benchmarks/classifier/peers.py: `python -m
benchmarks.classifier.child SPEC_JSON` prints one JSON line (the figures, or {"error": one
line}); the rest goes to stderr.

It loads one artifact exactly as `compress bench` does (`rebench.load_artifact`: int8
compiled with freezing, exports in their runtime; the Optimum folders are ONNX export
folders), then measures accuracy on the eval split (when asked), the fixed-length sweep
(`measure.latency_sweep`) and latency at real lengths (`measure.real_latency`). (The GEMM
peak runs in its own process: benchmarks/harness/gemm.py.)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.child_main import run_in_compress
from benchmarks.harness.runs import eval_recipe


def artifact(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one artifact and measure it; the figures with `pid` and `load_s`."""
    from compress.data.datasets import load_data
    from compress.measure.evaluate import evaluate
    from compress.measure.figures import latency_sweep, real_latency
    from compress.recipe.datasets import resolve_data
    from compress.report.rebench import load_for_child

    recipe = eval_recipe(Path(spec["run_dir"]))
    data = load_data(recipe, resolve_data(recipe.data.source))  # the run's eval split
    examples = data.splits["eval"]
    bundle, lat, load_s = load_for_child(spec)
    figures: dict[str, Any] = {"load_s": load_s}
    if spec.get("accuracy"):
        began = time.perf_counter()
        figures.update(evaluate(bundle.model.eval(), examples, recipe.evaluation.batch_size,
                                bundle.tokenizer, data.max_length, data.num_labels))
        figures["eval_size"] = len(examples)
        figures["eval_s"] = round(time.perf_counter() - began, 3)
    figures.update(latency_sweep(bundle, lat))
    if bundle.is_text:
        figures.update(real_latency(bundle, examples, lat.batch_sizes, data.max_length,
                                    lat.threads, limit=spec.get("real_limit"),
                                    warmup=lat.warmup))
    return {**figures, "folder": spec["folder"], "pid": os.getpid()}


def main(argv: list[str] | None = None) -> int:
    """Measure and print the JSON line; 1 with {"error": ...} when it fails."""
    return run_in_compress(artifact, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
