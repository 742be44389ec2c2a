"""One fresh process of benchmarks/peers.py: `python benchmarks/peers_child.py SPEC_JSON`
prints one JSON line (the figures, or {"error": one line}); the rest goes to stderr.

Two modes:
- "artifact": load one artifact exactly as `compress bench` does (`rebench.load_artifact`:
  int8 compiled with freezing, exports in their runtime; the Optimum folders are ONNX
  export folders), then accuracy on the eval split (when asked), the fixed-length sweep
  (`measure.latency_sweep`) and latency at real lengths (`measure.real_latency`).
- "gemm": peak throughput of plain matrix products on all cores: fp32 and bf16 `torch.mm`,
  int8 x int8 -> int32 `torch._int_mm` (B row- and column-major), ONNX Runtime's
  MatMulInteger (u8 x s8, the kernel its int8 models run), the best of a few shapes, and
  the machine. `int8_gops` is the better int8 kernel. Without AVX512-BF16 bf16 products
  are emulated, and without AVX512-VNNI or AMX `_int_mm` has no fast kernel (2-3 GOP/s on
  an AVX2-only EPYC, where ONNX Runtime's AVX2 kernel reached about 190).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# (m, k, n): square, and MiniLM's feed-forward up-projection at 8 x 128 tokens
GEMM_SHAPES = ((1024, 1024, 1024), (1024, 384, 1536))


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


def eval_recipe(run_dir: Path) -> Any:
    """The run's recipe (recipe.yaml) without its stages: its data section, seed and
    evaluation settings, so `load_data` reads the eval split alone. (The stages are left
    out also because the recipe.yaml of runs made before compress wrote it as given, with
    every default filled in, does not validate again when it has export stages.)"""
    return _recipe(run_dir, with_stages=False)


def full_recipe(run_dir: Path) -> Any:
    """The run's recipe (recipe.yaml) with its stages, so `load_data` reads every split."""
    return _recipe(run_dir, with_stages=True)


def _recipe(run_dir: Path, with_stages: bool) -> Any:
    from compress.errors import UserError
    from compress.recipe.files import read_yaml
    from compress.recipe.schema import validate_raw

    raw = read_yaml(run_dir / "recipe.yaml")
    recipe, problems = validate_raw(raw if with_stages else {**raw, "stages": []})
    if recipe is None or problems:
        raise UserError([f"{run_dir / 'recipe.yaml'}: {p}" for p in problems or ["invalid"]])
    return recipe


def _rate(run: Any, flops: float, min_s: float = 0.4) -> float:
    """flops / the median time of `run()` over `min_s` seconds of calls (at least one,
    after one untimed: an emulated bf16 or int8 product can take a second a call)."""
    run()  # warm up
    times: list[float] = []
    began = time.perf_counter()
    while not times or time.perf_counter() - began < min_s:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times)


def gemm(spec: dict[str, Any]) -> dict[str, Any]:
    """GFLOP/s (fp32, bf16) and GOP/s (int8) of the best shape, per shape too."""
    import torch

    from compress.runfolder.files import environment

    threads = spec.get("threads") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    per_shape: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for m, k, n in spec.get("shapes") or GEMM_SHAPES:
            ops = 2.0 * m * k * n
            a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
            a16, b16 = a.bfloat16(), b.bfloat16()
            a8 = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
            b8 = torch.randint(-128, 128, (k, n), generator=gen, dtype=torch.int8)
            b8t = b8.t().contiguous().t()  # the same values, column-major (a weight's layout)
            per_shape[f"{m}x{k}x{n}"] = {
                "fp32_gflops": _rate(lambda a=a, b=b: torch.mm(a, b), ops) / 1e9,
                "bf16_gflops": _rate(lambda a=a16, b=b16: torch.mm(a, b), ops) / 1e9,
                "int8_torch_gops": max(_rate(lambda a=a8, b=w: torch._int_mm(a, b), ops)
                                       for w in (b8, b8t)) / 1e9,
                "int8_ort_gops": _ort_int8_rate(m, k, n, threads) / 1e9,
            }
    best = {key: round(max(s[key] for s in per_shape.values()), 1)
            for key in ("fp32_gflops", "bf16_gflops", "int8_torch_gops", "int8_ort_gops")}
    best["int8_gops"] = max(best["int8_torch_gops"], best["int8_ort_gops"])
    shapes = {name: {k: round(v, 1) for k, v in s.items()} for name, s in per_shape.items()}
    return {**best, "threads": threads, "shapes": shapes, "environment": environment(),
            "pid": os.getpid()}


def _ort_int8_rate(m: int, k: int, n: int, threads: int) -> float:
    """Ops per second of a one-node ONNX Runtime MatMulInteger (u8 activations x s8
    weights -> int32), the product ONNX Runtime's int8 models run."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.integers(-128, 128, (k, n), dtype=np.int8), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "W"], ["Y"])], "gemm",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [m, k])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, [m, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feed = {"A": rng.integers(0, 256, (m, k), dtype=np.uint8)}
    return _rate(lambda: session.run(None, feed), 2.0 * m * k * n)


def main(argv: list[str] | None = None) -> int:
    """Run the spec's mode and print its JSON line; 1 with {"error": ...} when it fails."""
    from compress.report.rebench import child_main

    return child_main(lambda spec: gemm(spec) if spec.get("mode") == "gemm" else artifact(spec),
                      argv)


if __name__ == "__main__":
    sys.exit(main())
