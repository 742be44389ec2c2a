"""This CPU's arithmetic peaks, measured: float32 FMA (`vfmadd231ps`) and AVX512-BF16's
`vdpbf16ps` GFLOP/s of one core (12 independent accumulators, 512-bit vectors where there is
AVX-512, else 256-bit FMA) times torch's threads, so that another process on a core of this
shared machine does not lower the peak it is compared with; built on first use by
`torch.utils.cpp_extension.load_inline` for this CPU. `python -m
benchmarks.causal_lm.micro.grouped_kernels --peak` quotes its products as shares of them.

    python -m benchmarks.harness.cpu_peak
"""

from __future__ import annotations

import argparse
import time

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int64_t LANES = 8;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline float total(Vec v) { return v[0]; }
#endif

// 12 independent accumulators, `iters` times: float32 FMA (BF16 false) or vdpbf16ps
template <bool BF16>
float run(int64_t iters) {
  Vec a[12];
  for (int j = 0; j < 12; ++j) a[j] = splat(j * 1e-9f);
  Vec w = splat(1.f), x = splat(0.5f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) {
#if defined(__AVX512BF16__)
      if constexpr (BF16)
        a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_castps_si512(w),
                                (__m512bh)_mm512_castps_si512(x));
      else
#endif
#if defined(__AVX512F__)
        a[j] = _mm512_fmadd_ps(w, x, a[j]);
#else
        a[j] = _mm256_fmadd_ps(w, x, a[j]);
#endif
    }
    __asm__ volatile("" : "+v"(w));
  }
  float sum = 0.f;
  for (int j = 0; j < 12; ++j) sum += total(a[j]);
  return sum;
}

// instructions a second on `threads` threads: kind 0 float32 FMA, 1 vdpbf16ps (-1 if absent)
double rate(int64_t kind, int64_t iters, int64_t threads) {
#if !defined(__AVX512BF16__)
  if (kind == 1) return -1;
#endif
  float sink = 0.f;
  const double began = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  sink += kind == 1 ? run<true>(iters) : run<false>(iters);
  const double seconds = omp_get_wtime() - began;
  return sink == 1.2345f ? 0 : 12.0 * iters * threads / seconds;
}

int64_t lanes() { return LANES; }  // float32 lanes a vector
"""


def peaks(iters: int = 20_000_000) -> dict[str, float | None]:
    """GFLOP/s of torch's threads, each at one core's rate (the best of three runs):
    "fp32" (FMA: 2 a lane) and "bf16" (vdpbf16ps: 4 a 32-bit lane; None without
    AVX512-BF16)."""
    import torch
    from torch.utils.cpp_extension import load_inline

    module = load_inline("compress_cpu_peak", SOURCE, functions=["rate", "lanes"],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"],
                         extra_ldflags=["-fopenmp"], verbose=False)
    threads, lanes = torch.get_num_threads(), module.lanes()
    found: dict[str, float | None] = {}
    for name, kind, flops in (("fp32", 0, 2 * lanes), ("bf16", 1, 4 * lanes)):
        best = threads * max(module.rate(kind, iters, 1) for _ in range(3))
        found[name] = best * flops / 1e9 if best > 0 else None
        time.sleep(0.1)
    return found


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    import torch

    found = peaks()
    bf16 = found["bf16"]
    print(f"threads {torch.get_num_threads()}: float32 FMA {found['fp32']:.1f} GFLOP/s, "
          + (f"vdpbf16ps {bf16:.1f} GFLOP/s ({bf16 / found['fp32']:.2f}x)" if bf16
             else "no AVX512-BF16"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
