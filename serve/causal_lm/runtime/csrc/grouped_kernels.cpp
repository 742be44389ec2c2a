// Grouped int8 / 4-bit weights times float32 activations, reading each weight group once for
// every row of the batch (built by grouped_kernels.py on first use; no Python inside).
//
//   out[m, n] = sum_g scale[n, g] * sum_{i in g} code[n, i] * x[m, i]
//             + sum_g offset[n, g] * sum_{i in g} x[m, i]
//
// which is x @ (code * scale + offset)^T to float32 rounding. Groups are 32 inputs. Codes
// come in as the modules keep them: int8 (bits 8) or 4-bit, two a byte (bits 4: in each
// group, byte j holds input j in its low nibble and input j + 16 in its high nibble, as a
// GGUF's Q4_0 and Q4_1 blocks do). The activations stay float32, so a model whose weights
// lie on these grids decodes the float model's tokens.
//
// `grouped_pack` lays a weight out for the product: output features in tiles of 16, and per
// tile and group one record: the codes input by input (16 outputs' codes of input i side by
// side; at 4 bits inputs 2p and 2p + 1 share a byte, low and high nibble), then the 16
// scales and 16 offsets: float16 (`half`, as a GGUF stores them) where every scale and
// offset of the weight is a float16 value, else float32. A thread reads one contiguous
// stream, which the hardware prefetcher follows.
//
// `grouped_mm` multiplies in outer-product form: per input, the 16 codes are widened to
// float32 once and multiplied with every activation row's value of that input (a
// broadcast), summed over the group, then scaled once per group; the offset is one
// multiply-add per group against the row's sum of x over the group. There is no
// dequantization per weight and no horizontal sum. Three paths, chosen at compile time
// (`grouped_mm_path` names the one built):
//
// - AVX-512 (`__AVX512F__`): a tile's 16 outputs are one zmm. Every row sums a group in 4
//   partial sums over alternating inputs (the multiply-adds of one chain need not wait on
//   each other), whatever the row count: rows go 4 a pass (INVARIANT_ROWS), while a tile's
//   records stay in cache, so a row's arithmetic is that of a one-row product, bit for bit,
//   in a batch of any size (batch invariance; until 2026-11 6-8 rows took one sum a row,
//   faster but another rounding).
// - AVX2 + FMA + F16C without AVX-512 (`-march=x86-64-v3`, a Zen 1-3, Haswell to Alder
//   Lake): a tile's 16 outputs are two ymm. Batch-invariant by construction at every row
//   count: each row sums a group in one multiply-add chain a half tile, input after input,
//   then acc += sum * scale and acc += xsum * offset, the same operations in the same order
//   whether the call has 1 row or 128; rows never share a sum, only the weights' widening.
//   A pass holds up to 12 chains: 1 row 4 tiles at once, 2 rows 2 tiles, 3-6 rows one tile,
//   more rows in even passes of up to 6 (8 rows: 4 + 4), each widening the codes as it
//   reads them.
// - portable (any other CPU): the same arithmetic as loops left to the compiler.
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "grouped_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define COMPRESS_AVX2_PATH 1
#endif

namespace compress_lm {
namespace {

#if defined(__AVX512F__)

// R activation rows against one tile: out[r, 0..15] for this tile
template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      const float* xsum, float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  // 4 partial sums per row (the multiply-adds of one chain need not wait on each other) at
  // every row count, so that a row's sums are those of a one-row step, bit for bit
  constexpr int P = 4;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m512 part[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) part[p][r] = _mm512_setzero_ps();
    const float* xg = x + g * GROUP;
    if constexpr (BITS == 8) {
      const __m128i* codes = reinterpret_cast<const __m128i*>(rec);
#pragma GCC unroll 32
      for (int i = 0; i < GROUP; ++i) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + i)));
        for (int r = 0; r < R; ++r)
          part[i % P][r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xg[r * k + i]), part[i % P][r]);
      }
    } else {
      const __m128i* codes = reinterpret_cast<const __m128i*>(rec);
      const __m512i mask = _mm512_set1_epi32(15);
#pragma GCC unroll 16
      for (int i = 0; i < GROUP; i += 2) {
        const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes + i / 2));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_and_si512(both, mask));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4));
        for (int r = 0; r < R; ++r) {
          part[i % P][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xg[r * k + i]), part[i % P][r]);
          part[(i + 1) % P][r] =
              _mm512_fmadd_ps(w1, _mm512_set1_ps(xg[r * k + i + 1]), part[(i + 1) % P][r]);
        }
      }
    }
    add_group<BITS, HALF>(rec, part, xsum, groups, g, acc);
  }
  store_rows(acc, out, n_out, valid);
}

#elif defined(COMPRESS_AVX2_PATH)

// AVX2 + FMA (+ F16C for float16 scales), no AVX-512: a tile's 16 outputs are two ymm. The
// arithmetic of an output never depends on how many rows or tiles a pass holds (batch
// invariance by construction): per group, one multiply-add chain a row and half tile, input
// after input, then acc += sum * scale and acc += xsum * offset, the same instructions in
// the same order at 1 row or 128. A pass holds T tiles x R rows, at most 12 chains (2 per
// tile and row) in the 16 ymm, enough to hide the multiply-add latency: 1 row goes 4 tiles
// a pass, 2 rows 2 tiles, 3-6 rows one tile, more rows in even passes of up to 6, every
// pass widening the codes as it reads them. Until 2026-11 a row took 2 chains, so a pass
// held at most 3 rows and more rows read the codes from a float32 copy of each group
// (stores and reloads); against it one chain a row runs a Zen 1's decode-step products 1.13x
// faster at 1 row and 1.10x at 8 (int8 codes) (benchmarks/results/llm_avx2_passes_zen1.md).
constexpr int64_t AVX2_ROWS = 6;  // rows a pass at most: 6 x 2 chains + 2 codes + 1 x

// input i's 16 codes as float32 (outputs 0-7, 8-15), exact
template <int BITS>
inline void record_codes(const uint8_t* rec, int i, __m256& lo, __m256& hi) {
  if constexpr (BITS == 8) {
    const uint8_t* c = rec + i * TILE;
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(c))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(c + 8))));
  } else {  // inputs 2p and 2p + 1: byte j's low and high nibble
    const uint8_t* c = rec + (i / 2) * TILE;
    __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)));
    if (i % 2) {
      a = _mm256_srli_epi32(a, 4);
      b = _mm256_srli_epi32(b, 4);
    } else {
      a = _mm256_and_si256(a, _mm256_set1_epi32(15));
      b = _mm256_and_si256(b, _mm256_set1_epi32(15));
    }
    lo = _mm256_cvtepi32_ps(a);
    hi = _mm256_cvtepi32_ps(b);
  }
}

// the tile's `valid` outputs of a row from its two accumulators
inline void store_row(const __m256 (&acc)[2], float* out, int64_t valid) {
  if (valid == TILE) {
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
  } else {
    alignas(32) float row[TILE];
    _mm256_store_ps(row, acc[0]);
    _mm256_store_ps(row + 8, acc[1]);
    std::memcpy(out, row, valid * sizeof(float));
  }
}

// R rows (x: k apart; xsum: their sums over each group, `groups` apart) against T
// consecutive tiles from `first` (tile_bytes apart): out[r, t * 16 + j], rows n_out apart;
// the last tile's `valid_last` outputs stored
template <int BITS, bool HALF, int T, int R>
inline void tiles_rows(const uint8_t* first, int64_t tile_bytes, int64_t groups, const float* x,
                       int64_t k, const float* xsum, float* out, int64_t n_out,
                       int64_t valid_last) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  __m256 acc[T][R][2];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rec[T];
    for (int t = 0; t < T; ++t) {
      rec[t] = first + t * tile_bytes + g * RB;
      _mm_prefetch(reinterpret_cast<const char*>(rec[t] + 4 * RB), _MM_HINT_T0);
    }
    const float* xg[R];  // each row's inputs of the group: R pointers in registers
    for (int r = 0; r < R; ++r) xg[r] = x + r * k + g * GROUP;
    __m256 sum[T][R][2];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) sum[t][r][0] = sum[t][r][1] = _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int i = 0; i < GROUP; ++i)
      for (int t = 0; t < T; ++t) {
        __m256 lo, hi;
        record_codes<BITS>(rec[t], i, lo, hi);
        for (int r = 0; r < R; ++r) {
          const __m256 xi = _mm256_broadcast_ss(xg[r] + i);
          sum[t][r][0] = _mm256_fmadd_ps(lo, xi, sum[t][r][0]);
          sum[t][r][1] = _mm256_fmadd_ps(hi, xi, sum[t][r][1]);
        }
      }
    for (int t = 0; t < T; ++t) {
      __m256 s[2], o[2];
      record_scales<BITS, HALF>(rec[t], s, o);
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_broadcast_ss(xsum + r * groups + g);
        for (int h = 0; h < 2; ++h) {
          acc[t][r][h] = _mm256_fmadd_ps(sum[t][r][h], s[h], acc[t][r][h]);
          acc[t][r][h] = _mm256_fmadd_ps(xs, o[h], acc[t][r][h]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      store_row(acc[t][r], out + r * n_out + t * TILE, t + 1 < T ? TILE : valid_last);
}

template <int BITS, bool HALF>
void tiles_pass(const float* x, const float* xsum, int64_t rows, int64_t k, int64_t n,
                const uint8_t* packed, float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP, tile_bytes = groups * record_bytes(BITS, HALF);
  if (rows == 0) return;
  const auto valid = [n](int64_t tile) { return std::min(TILE, n - tile * TILE); };
  int64_t t = begin;
  // 1 row 4 tiles a pass, 2 rows 2 tiles; the tiles left over go one a pass below
  if (rows == 1)
    for (; t + 4 <= end; t += 4)
      tiles_rows<BITS, HALF, 4, 1>(packed + t * tile_bytes, tile_bytes, groups, x, k, xsum,
                                   out + t * TILE, n, valid(t + 3));
  if (rows == 2)
    for (; t + 2 <= end; t += 2)
      tiles_rows<BITS, HALF, 2, 2>(packed + t * tile_bytes, tile_bytes, groups, x, k, xsum,
                                   out + t * TILE, n, valid(t + 1));
  const int64_t passes = (rows + AVX2_ROWS - 1) / AVX2_ROWS;
  const int64_t per_pass = (rows + passes - 1) / passes;  // 8 rows: 2 passes of 4
  for (; t < end; ++t)
    for (int64_t m = 0; m < rows; m += per_pass)
      with_rows(std::min(per_pass, rows - m), [&](auto r) {  // at most AVX2_ROWS
        tiles_rows<BITS, HALF, 1, decltype(r)::value>(packed + t * tile_bytes, tile_bytes,
                                                      groups, x + m * k, k, xsum + m * groups,
                                                      out + m * n + t * TILE, n, valid(t));
      });
}

#else  // portable: the same arithmetic, left to the compiler to vectorize

template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      const float* xsum, float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  float acc[R][TILE] = {};
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    float part[R][TILE] = {};
    const float* xg = x + g * GROUP;
    for (int i = 0; i < GROUP; ++i) {
      float w[TILE];
      for (int j = 0; j < TILE; ++j) {
        if constexpr (BITS == 8) {
          w[j] = static_cast<float>(static_cast<int8_t>(rec[i * TILE + j]));
        } else {
          const uint8_t both = rec[(i / 2) * TILE + j];
          w[j] = static_cast<float>(i % 2 ? both >> 4 : both & 15);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < TILE; ++j) part[r][j] += w[j] * xg[r * k + i];
    }
    float scale[2 * TILE];
    record_scales<BITS, HALF>(rec, scale);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < TILE; ++j)
        acc[r][j] += part[r][j] * scale[j] + xsum[r * groups + g] * scale[TILE + j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < valid; ++j) out[r * n_out + j] = acc[r][j];
}

#endif

#if !defined(COMPRESS_AVX2_PATH)  // AVX-512: 4 rows a pass; portable: up to ROWS
template <int BITS, bool HALF>
void tiles_pass(const float* x, const float* xsum, int64_t rows, int64_t k, int64_t n,
                const uint8_t* packed, float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP;
  const int64_t tile_bytes = groups * record_bytes(BITS, HALF);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    for (int64_t m = 0; m < rows; m += FLOAT_PASS_ROWS)
      with_rows(std::min(FLOAT_PASS_ROWS, rows - m), [&](auto r) {
        tile_rows<BITS, HALF, decltype(r)::value>(packed + t * tile_bytes, groups, x + m * k,
                                                  k, xsum + m * groups, out + m * n + n0, n,
                                                  valid);
      });
  }
}
#endif

// code of output `row`, input `i`, as the modules keep codes
inline int code_at(const uint8_t* codes, int64_t k, int64_t bits, int64_t row, int64_t i) {
  if (bits == 8) return codes[row * k + i];
  const int64_t g = i / GROUP, j = i % GROUP;
  const uint8_t both = codes[row * (k / 2) + g * (GROUP / 2) + j % (GROUP / 2)];
  return j < GROUP / 2 ? both & 15 : both >> 4;
}

at::Tensor grouped_pack(const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& offset, int64_t bits, bool half) {
  TORCH_CHECK(bits == 8 || bits == 4, "grouped_pack: bits must be 8 or 4, not ", bits);
  const int64_t n = scale.size(0), groups = scale.size(1), k = groups * GROUP;
  TORCH_CHECK(codes.size(0) == n && codes.size(1) * 8 == k * bits &&
                  offset.sizes() == scale.sizes(),
              "grouped_pack: codes ", codes.sizes(), " and scale ", scale.sizes(),
              " do not describe groups of ", GROUP, " at ", bits, " bits");
  const int64_t tiles = (n + TILE - 1) / TILE, rb = record_bytes(bits, half);
  at::Tensor packed = at::zeros({tiles * groups * rb}, codes.options().dtype(at::kByte));
  const at::Tensor c = codes.contiguous(), s = scale.contiguous().to(at::kFloat),
                   o = offset.contiguous().to(at::kFloat);
  const uint8_t* cp = static_cast<const uint8_t*>(c.data_ptr());
  const float* sp = s.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t t = row / TILE, j = row % TILE;
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* rec = out + (t * groups + g) * rb;
      for (int64_t i = 0; i < GROUP; ++i) {
        const int code = code_at(cp, k, bits, row, g * GROUP + i);
        if (bits == 8)
          rec[i * TILE + j] = static_cast<uint8_t>(code);
        else
          rec[(i / 2) * TILE + j] |= static_cast<uint8_t>(i % 2 ? code << 4 : code);
      }
      if (!half) {
        float* sr = reinterpret_cast<float*>(rec + code_bytes(bits));
        sr[j] = sp[row * groups + g];
        sr[TILE + j] = op[row * groups + g];
      } else {
        at::Half* sr = reinterpret_cast<at::Half*>(rec + code_bytes(bits));
        sr[j] = static_cast<at::Half>(sp[row * groups + g]);
        sr[TILE + j] = static_cast<at::Half>(op[row * groups + g]);
      }
    }
  }
  return packed;
}

// which of the three paths this build multiplies with
std::string grouped_mm_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(COMPRESS_AVX2_PATH)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                      bool half) {
  const at::Tensor x2 = product_rows(x, packed, n, bits, half, "grouped_mm");
  const int64_t k = x.size(-1), groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const int64_t rows = x2.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x2.data_ptr<float>();
  std::vector<float> xsum(rows * groups);  // each row's sum of x over each group
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) total += xp[r * k + g * GROUP + j];
      xsum[r * groups + g] = total;
    }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  const float* xs = xsum.data();
  // tiles split across threads; each thread streams its tiles' records once
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    with_layout(bits, half, [&](auto b, auto h) {
      tiles_pass<decltype(b)::value, decltype(h)::value>(xp, xs, rows, k, n, pp, yp, begin, end);
    });
  });
  return out.view(out_shape);
}

}  // namespace compress_lm

TORCH_LIBRARY(compress_lm, m) {
  m.def("grouped_pack(Tensor codes, Tensor scale, Tensor offset, int bits, bool half) -> Tensor");
  m.def("grouped_mm(Tensor x, Tensor packed, int n, int bits, bool half) -> Tensor");
  m.def("grouped_mm_path() -> str", &compress_lm::grouped_mm_path);
  // grouped_int8_activations.cpp
  m.def("grouped_mm_int8(Tensor x, Tensor packed, int n, int bits, bool half) -> Tensor");
  // grouped_bf16_activations.cpp
  m.def("grouped_mm_bf16(Tensor x, Tensor packed, int n, int bits, bool half) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("grouped_pack", &compress_lm::grouped_pack);
  m.impl("grouped_mm", &compress_lm::grouped_mm);
}
