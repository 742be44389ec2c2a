"""The grouped-weight kernel (serve/causal_lm/runtime/csrc/grouped_kernels.cpp) alone, on
SmolLM2-135M's shapes: every product of one decode step (30 layers x q, k, v, o, gate, up, down,
and the output projection), at 8 and 4 bits, for 1, 2, 8 and 128 activation rows; per shape the
median time and the GB/s of the records it reads; per row count the step's total, its GB/s and
GFLOP/s (or GOP/s). Random codes, float16 scales, as a GGUF's groups give them. With
`--activations int8`, the opt-in mode's product (`grouped_mm_int8`: activations rounded to
int8 per group of 32, VNNI integer products) instead of the float32 one; with `--activations
bf16`, the other opt-in mode's (`grouped_mm_bf16`: activations rounded to bfloat16,
AVX512-BF16's vdpbf16ps; the float32 product where the build lacks it). With `--peak`, each
step's GFLOP/s also as a share of this CPU's measured peak for its arithmetic
(`benchmarks/harness/cpu_peak.py`: float32 FMA for float32, vdpbf16ps for bf16). With
`--weights sparse24`, the 2:4 kernel (`sparse24_kernel.cpp`'s `sparse24_mm`: kept codes,
2-bit positions, float16 scales; random 2:4 weights) on the same shapes, its GB/s of its
own, smaller records.

    python -m benchmarks.causal_lm.micro.grouped_kernels            # about a minute
    python -m benchmarks.causal_lm.micro.grouped_kernels --rows 1 --repeats 50
    python -m benchmarks.causal_lm.micro.grouped_kernels --rows 8,128 --activations int8
    python -m benchmarks.causal_lm.micro.grouped_kernels --rows 8,128 --activations bf16 --peak
    python -m benchmarks.causal_lm.micro.grouped_kernels --rows 1,8 --weights sparse24
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.harness.provenance import header_text
from serve.causal_lm.runtime.kernels import (
    bf16_native,
    build_error,
    grouped_mm_available,
)
from serve.causal_lm.runtime.sparse24 import fit_sparse24, pack_codes, pack_records

PRODUCTS = {"float32": "grouped_mm", "int8": "grouped_mm_int8", "bf16": "grouped_mm_bf16"}
# (out, in, calls a step) of SmolLM2-135M: q, k, v, o, gate, up, down per layer; the head
SHAPES = ((576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30), (49152, 576, 1))


def packed_weight(out: int, inputs: int, bits: int) -> torch.Tensor:
    codes = torch.randint(0, 127 if bits == 8 else 255, (out, inputs * bits // 8),
                          dtype=torch.uint8)
    scale = torch.rand(out, inputs // 32).half().float()
    offset = torch.rand(out, inputs // 32).half().float()
    return torch.ops.compress_lm.grouped_pack(codes, scale, offset, bits, True)


def sparse24_weight(out: int, inputs: int, bits: int) -> torch.Tensor:
    """A random 2:4 weight in `sparse24_mm`'s records."""
    weight = torch.randn(out, inputs).reshape(out, inputs // 4, 4)
    weight.scatter_(-1, torch.rand(out, inputs // 4, 4).topk(2, dim=-1).indices, 0.0)
    codes, positions, scale = fit_sparse24(weight.reshape(out, inputs), bits)
    return pack_records(pack_codes(codes, bits), positions, scale, bits)


def median_s(x: torch.Tensor, packed: list[torch.Tensor], out: int, bits: int,
             repeats: int, product: str = "grouped_mm") -> float:
    """Median seconds of one product, cycling through copies so that none stays cached."""
    times, call = [], getattr(torch.ops.compress_lm, product)
    extra = () if product == "sparse24_mm" else (True,)  # sparse24_mm: no `half`
    for i in range(repeats):
        weight = packed[i % len(packed)]
        start = time.perf_counter()
        call(x, weight, out, bits, *extra)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,128", help="activation rows (1,2,8,128)")
    parser.add_argument("--repeats", type=int, default=30, help="timings a shape (30)")
    parser.add_argument("--activations", choices=tuple(PRODUCTS), default="float32",
                        help="the product: float32 activations (grouped_mm), int8 "
                             "(grouped_mm_int8) or bf16 (grouped_mm_bf16)")
    parser.add_argument("--weights", choices=("grouped", "sparse24"), default="grouped",
                        help="the dense grouped records (grouped) or the 2:4 ones "
                             "(sparse24: sparse24_mm, float32 activations)")
    parser.add_argument("--peak", action="store_true",
                        help="also each step's share of the measured float32 / bf16 peak")
    args = parser.parse_args(argv)
    product = PRODUCTS[args.activations] if args.weights == "grouped" else "sparse24_mm"
    make = packed_weight if args.weights == "grouped" else sparse24_weight
    if not grouped_mm_available():
        print(f"error: the kernel could not be built: {build_error()}", file=sys.stderr)
        return 1
    native = "" if args.activations != "bf16" or bf16_native() else \
        " (built without AVX512-BF16: the float32 product)"
    found = None
    if args.peak and args.activations != "int8":
        from benchmarks.harness.cpu_peak import peaks

        found = peaks()
    print(header_text("benchmarks.causal_lm.micro.grouped_kernels", argv, peaks=found))
    print(f"threads {torch.get_num_threads()}; {args.weights} weights; "
          f"{args.activations} activations{native}; "
          "shapes: (out, in, calls a step)")
    peak = None
    if found is not None:
        peak = found["bf16" if args.activations == "bf16" and native == "" else "fp32"]
        print(f"peak: float32 FMA {found['fp32']:.1f} GFLOP/s, vdpbf16ps "
              f"{found['bf16'] or 0:.1f} GFLOP/s (0: no AVX512-BF16)")
    for bits in (8, 4):
        weights = {}
        for out, inputs, _ in SHAPES:  # ~64 MB of copies a shape: past the caches
            one = make(out, inputs, bits)
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
                  f"  {rows / total_s:6.0f} rows/s"
                  + (f"  {flops / total_s / 1e9 / peak:4.0%} of peak" if peak else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
