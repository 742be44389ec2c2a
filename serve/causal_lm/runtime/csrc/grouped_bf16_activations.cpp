// Grouped int8 / 4-bit weights times bfloat16 activations: the opt-in `activations: bf16`
// mode of the grouped schemes, for prefills and batched decode (built with
// grouped_kernels.cpp; it reads the same records, grouped_layout.h).
//
// Each activation row is rounded to bfloat16 (to nearest, ties to even, as torch's
// Tensor.bfloat16() does). The codes are exact in bfloat16 (int8: -128..127; 4-bit: 0..15),
// so per output feature n and group g
//
//   out[m, n] = sum_g scale[n, g] * sum_{i in g} code[n, i] * xb[m, i]
//             + sum_g offset[n, g] * sum_{i in g} xb[m, i]
//
// is xb @ (code * scale + offset)^T, the rounded activations' exact product, to float32
// summation order. The inner sums run on AVX512-BF16's `vdpbf16ps` (32 products an
// instruction where a float32 FMA does 16): per pair of inputs (2p, 2p + 1), the 16
// outputs' codes are widened into 32 bfloat16 values, 32-bit lane j holding output j's
// pair, and each row's two rounded activations of that pair (the rows of a chunk side by
// side, one 32-bit value) are broadcast against them. int8 codes: sign-extended, converted
// to float32, whose upper halves are then their bfloat16 values, two inputs joined by a
// shift and an or (a vpermt2w instead: 1.62x the float32 kernel at 8 rows, not 1.77x, on a
// Zen 4); 4-bit codes: a byte's two nibbles made two 16-bit indices (b | b << 12) into a
// 16-entry `vpermw` table. Codes widened as they are read beat a buffer for a chunk
// (through a buffer, 8 rows took 1.4x as long). Every row is summed in 4 partial sums a
// group at every row count, 4 rows a chunk (INVARIANT_ROWS): a row gets the same bits alone
// (a decode step of one row is rounded too) and in any batch. Up to 4 rows the codes are
// widened as they are read; more rows widen a tile's codes once into a scratch buffer that
// every chunk then reads from cache. Without AVX512-BF16 the operator is the exact float32
// product (`grouped_bf16_native` says which): no emulation.
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "grouped_layout.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define COMPRESS_LM_BF16 1
#endif

namespace compress_lm {
namespace {

#if defined(COMPRESS_LM_BF16)

constexpr int PAIRS = GROUP / 2;  // input pairs a group: one vdpbf16ps each per row

// rows x k activations rounded to bfloat16 (to nearest even, as Tensor.bfloat16(); by
// vcvtne2ps2bf16, which reads a float32 denormal as zero, as vdpbf16ps reads a bfloat16 one)
// as pairs of inputs, one 32-bit value each, interleaved by chunk of INVARIANT_ROWS rows:
// pair q of row r of a chunk of R rows is at chunk * INVARIANT_ROWS * k / 2 + q * R + r, so
// that a chunk's rows of a pair lie side by side; and each row's sum of the rounded values
// over each group
struct Bf16Rows {
  std::vector<int32_t> pairs;
  std::vector<float> sums;
};

Bf16Rows round_rows_bf16(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP, half = k / 2;
  Bf16Rows r{std::vector<int32_t>(rows * half), std::vector<float>(rows * groups)};
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> line(half);  // one row's pairs, in order
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + row * k + g * GROUP;
        const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xg + TILE),
                                                           _mm512_loadu_ps(xg));
        _mm512_storeu_si512(line.data() + g * PAIRS, pairs);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
        r.sums[row * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      }
      const int64_t chunk = row / INVARIANT_ROWS,
                    height = std::min(INVARIANT_ROWS, rows - chunk * INVARIANT_ROWS);
      int32_t* out = r.pairs.data() + chunk * INVARIANT_ROWS * half + row % INVARIANT_ROWS;
      for (int64_t q = 0; q < half; ++q) out[q * height] = line[q];
    }
  });
  return r;
}

// the bfloat16 of the 4-bit codes: entry u is bf16(u % 16) (vpermw reads 5 index bits)
inline __m512i nibble_table() {
  alignas(64) float values[32];
  for (int u = 0; u < 32; ++u) values[u] = static_cast<float>(u % 16);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(values + 16), _mm512_load_ps(values));
}

// the record's codes of inputs 2p and 2p + 1 as bfloat16 pairs: 16 lanes of 32 bits,
// lane j = (code[j, 2p], code[j, 2p + 1])
template <int BITS>
inline __m512i pair_codes(const uint8_t* rec, int p, __m512i table) {
  const __m128i* codes = reinterpret_cast<const __m128i*>(rec);
  if constexpr (BITS == 8) {
    // float32 of an int8 code has 16 zero low bits: its upper half is its bfloat16
    const __m512i even = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 2 * p))));
    const __m512i odd = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 2 * p + 1))));
    return _mm512_or_si512(_mm512_srli_epi32(even, 16), odd);
  } else {
    // byte j: input 2p low nibble, 2p + 1 high; b | b << 12 puts them in words 2j, 2j + 1
    const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes + p));
    const __m512i index = _mm512_or_si512(both, _mm512_slli_epi32(both, 12));
    return _mm512_permutexvar_epi16(index, table);
  }
}

// a tile's codes as bfloat16 pairs (`pair_codes`), group after group
template <int BITS, bool HALF>
void widen_tile(const uint8_t* rec, int64_t groups, __m512i* out, __m512i table) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  for (int64_t g = 0; g < groups; ++g, rec += RB, out += PAIRS) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int p = 0; p < PAIRS; ++p) _mm512_store_si512(out + p, pair_codes<BITS>(rec, p, table));
  }
}

// R rounded activation rows against one tile: out[r, 0..15] for this tile; the codes
// widened as they are read (DIRECT: one chunk of rows) or read widened from `wide`
template <int BITS, bool HALF, int R, bool DIRECT>
inline void tile_rows(const uint8_t* rec, const __m512i* wide, __m512i table, int64_t groups,
                      const int32_t* x, const float* xsum, float* out, int64_t n_out,
                      int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  // 4 partial sums (independent vdpbf16ps chains in flight) at every row count, so that a
  // row is summed as a lone row is (batch invariance); hence at most 4 rows a chunk
  constexpr int P = 4;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB, wide += PAIRS) {
    if constexpr (DIRECT) _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m512 part[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) part[p][r] = _mm512_setzero_ps();
    const int32_t* xg = x + g * PAIRS * R;  // the chunk's rows' pairs of this group
#pragma GCC unroll 16
    for (int p = 0; p < PAIRS; ++p) {
      const __m512bh w = (__m512bh)(DIRECT ? pair_codes<BITS>(rec, p, table)
                                           : _mm512_load_si512(wide + p));
      for (int r = 0; r < R; ++r)
        part[p % P][r] = _mm512_dpbf16_ps(part[p % P][r], w,
                                          (__m512bh)_mm512_set1_epi32(xg[p * R + r]));
    }
    add_group<BITS, HALF>(rec, part, xsum, groups, g, acc);
  }
  store_rows(acc, out, n_out, valid);
}

template <int BITS, bool HALF>
void bf16_tiles_pass(const Bf16Rows& x, int64_t rows, int64_t k, int64_t n,
                     const uint8_t* packed, float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP, tile_bytes = groups * record_bytes(BITS, HALF);
  const __m512i table = nibble_table();
  // one chunk of rows: codes widened as they are read; more: a tile's widened once, here
  std::vector<__m512i> wide(rows > INVARIANT_ROWS ? groups * PAIRS : 0);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    const uint8_t* rec = packed + t * tile_bytes;
    if (rows > INVARIANT_ROWS) widen_tile<BITS, HALF>(rec, groups, wide.data(), table);
    for (int64_t m = 0; m < rows; m += INVARIANT_ROWS) {
      const int32_t* xm = x.pairs.data() + m * (k / 2);
      const float* sums = x.sums.data() + m * groups;
      float* o = out + m * n + n0;
      with_rows(std::min(INVARIANT_ROWS, rows - m), [&](auto r) {
        constexpr int R = decltype(r)::value;
        if (rows > INVARIANT_ROWS)
          tile_rows<BITS, HALF, R, false>(rec, wide.data(), table, groups, xm, sums, o, n, valid);
        else
          tile_rows<BITS, HALF, R, true>(rec, nullptr, table, groups, xm, sums, o, n, valid);
      });
    }
  }
}

at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& x2, const at::Tensor& packed,
                        int64_t n, int64_t bits, bool half) {
  const int64_t k = x2.size(1), rows = x2.size(0), tiles = (n + TILE - 1) / TILE;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  const Bf16Rows rounded = round_rows_bf16(x2.data_ptr<float>(), rows, k);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    with_layout(bits, half, [&](auto b, auto h) {
      bf16_tiles_pass<decltype(b)::value, decltype(h)::value>(rounded, rows, k, n, pp, yp,
                                                              begin, end);
    });
  });
  return out.view(out_shape);
}

#endif

at::Tensor grouped_mm_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           int64_t bits, bool half) {
  const at::Tensor x2 = product_rows(x, packed, n, bits, half, "grouped_mm_bf16");
#if defined(COMPRESS_LM_BF16)
  return bf16_product(x, x2, packed, n, bits, half);  // every row count: batch-invariant
#else
  return grouped_mm(x, packed, n, bits, half);  // no AVX512-BF16: exact float32
#endif
}

// whether this build rounds to bfloat16 and uses vdpbf16ps (else grouped_mm_bf16 is exact)
bool grouped_bf16_native() {
#if defined(COMPRESS_LM_BF16)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace compress_lm

TORCH_LIBRARY_FRAGMENT(compress_lm, m) {
  m.def("grouped_bf16_native() -> bool", &compress_lm::grouped_bf16_native);
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("grouped_mm_bf16", &compress_lm::grouped_mm_bf16);
}
