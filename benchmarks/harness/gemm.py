"""The GEMM microbenchmark the classifier and embedding peers run in a process of its own
before and after their rounds (the better of the two is the peak): `python -m
benchmarks.harness.gemm SPEC_JSON` prints one JSON line.

Peak throughput of plain matrix products on all cores: fp32 and bf16 `torch.mm`, int8 x
int8 -> int32 `torch._int_mm` (B row- and column-major), ONNX Runtime's MatMulInteger (u8 x
s8, the kernel its int8 models run), the best of a few shapes, and the machine. `int8_gops`
is the better int8 kernel. Without AVX512-BF16 bf16 products are emulated, and without
AVX512-VNNI or AMX `_int_mm` has no fast kernel (2-3 GOP/s on an AVX2-only EPYC, where ONNX
Runtime's AVX2 kernel reached about 190).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from benchmarks.harness.child_main import run_in_compress

# (m, k, n): square, and MiniLM's feed-forward up-projection at 8 x 128 tokens
GEMM_SHAPES = ((1024, 1024, 1024), (1024, 384, 1536))
KEYS = ("fp32_gflops", "bf16_gflops", "int8_torch_gops", "int8_ort_gops", "int8_gops")


def run(shapes: list[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """One GEMM run in a fresh process of compress's environment (on `shapes`, default
    GEMM_SHAPES): its figures, or {"error": one line}."""
    from benchmarks.harness.rounds import run_module

    spec: dict[str, Any] = {"mode": "gemm"}
    if shapes:
        spec["shapes"] = [list(shape) for shape in shapes]
    return run_module(sys.executable, "benchmarks.harness.gemm", spec)


def peaks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The better of the GEMM runs per precision (None where none succeeded)."""
    ok = [r for r in runs if "error" not in r]
    return {key: max((r[key] for r in ok), default=None) for key in KEYS}


def brief(gemm: dict[str, Any]) -> str:
    """One GEMM run as a line of progress."""
    return f"failed: {gemm['error']}" if "error" in gemm else (
        f"fp32 {gemm['fp32_gflops']} GFLOP/s, bf16 {gemm['bf16_gflops']} GFLOP/s, "
        f"int8 {gemm['int8_gops']} GOP/s (torch._int_mm {gemm.get('int8_torch_gops')}, "
        f"ONNX Runtime {gemm.get('int8_ort_gops')})")


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
    """Measure and print the JSON line; 1 with {"error": ...} when it fails."""
    return run_in_compress(gemm, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
