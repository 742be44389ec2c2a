"""The grouped-weight kernel (serve/causal_lm/grouped_kernels.cpp) alone, on SmolLM2-135M's shapes:
every product of one decode step (30 layers x q, k, v, o, gate, up, down, and the output
projection), at 8 and 4 bits, for 1, 2, 8 and 128 activation rows; per shape the median
time and the GB/s of the records it reads; per row count the step's total, its GB/s and
GFLOP/s (or GOP/s). Random codes, float16 scales, as a GGUF's groups give them. With
`--activations int8`, the opt-in mode's product (`grouped_mm_int8`: activations rounded to
int8 per group of 32, VNNI integer products) instead of the float32 one.

    python benchmarks/grouped_kernels.py            # about a minute
    python benchmarks/grouped_kernels.py --rows 1 --repeats 50
    python benchmarks/grouped_kernels.py --rows 8,128 --activations int8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve.causal_lm.grouped_kernels import build_error, grouped_mm_available  # noqa: E402

# (out, in, calls a step) of SmolLM2-135M: q, k, v, o, gate, up, down per layer; the head
SHAPES = ((576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30), (49152, 576, 1))


def packed_weight(out: int, inputs: int, bits: int) -> torch.Tensor:
    codes = torch.randint(0, 127 if bits == 8 else 255, (out, inputs * bits // 8),
                          dtype=torch.uint8)
    scale = torch.rand(out, inputs // 32).half().float()
    offset = torch.rand(out, inputs // 32).half().float()
    return torch.ops.compress_lm.grouped_pack(codes, scale, offset, bits, True)


def median_s(x: torch.Tensor, packed: list[torch.Tensor], out: int, bits: int,
             repeats: int, product: str = "grouped_mm") -> float:
    """Median seconds of one product, cycling through copies so that none stays cached."""
    times, call = [], getattr(torch.ops.compress_lm, product)
    for i in range(repeats):
        weight = packed[i % len(packed)]
        start = time.perf_counter()
        call(x, weight, out, bits, True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,128", help="activation rows (1,2,8,128)")
    parser.add_argument("--repeats", type=int, default=30, help="timings a shape (30)")
    parser.add_argument("--activations", choices=("float32", "int8"), default="float32",
                        help="the product: float32 activations (grouped_mm), or int8 "
                             "(grouped_mm_int8)")
    args = parser.parse_args(argv)
    product = "grouped_mm" if args.activations == "float32" else "grouped_mm_int8"
    if not grouped_mm_available():
        print(f"error: the kernel could not be built: {build_error()}", file=sys.stderr)
        return 1
    print(f"threads {torch.get_num_threads()}; {args.activations} activations; shapes: "
          "(out, in, calls a step)")
    for bits in (8, 4):
        weights = {}
        for out, inputs, _ in SHAPES:  # ~64 MB of copies a shape: past the caches
            one = packed_weight(out, inputs, bits)
            copies = max(1, (64 << 20) // one.numel())
            weights[out, inputs] = [one] + [one.clone() for _ in range(min(copies, 40) - 1)]
        for rows in (int(r) for r in args.rows.split(",")):
            total_s = total_bytes = flops = 0.0
            for out, inputs, calls in SHAPES:
                x = torch.randn(rows, inputs)
                packed = weights[out, inputs]
                seconds = median_s(x, packed, out, bits, args.repeats if out < 10000 else 5,
                                   product)
                size = packed[0].numel()
                total_s += seconds * calls
                total_bytes += size * calls
                flops += 2 * rows * out * inputs * calls
                print(f"bits {bits} rows {rows:>3} {out:>6} x {inputs:<5} x{calls:<3} "
                      f"{seconds * 1e6:9.1f} us  {size / seconds / 1e9:5.1f} GB/s")
            print(f"bits {bits} rows {rows:>3} step {total_s * 1e3:7.2f} ms  "
                  f"{total_bytes / total_s / 1e9:5.1f} GB/s  {flops / total_s / 1e9:6.1f} GFLOP/s"
                  f"  {rows / total_s:6.0f} rows/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
