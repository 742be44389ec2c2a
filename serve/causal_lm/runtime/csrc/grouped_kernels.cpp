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
//   count: each row sums a group in 2 partial sums (input i into sum i % 2), adds them,
//   then acc += sum * scale and acc += xsum * offset, the same operations in the same order
//   whether the call has 1 row or 128; rows never share a sum, only the weights' widening.
//   Rows go 3 a pass (3 rows x 2 sums x 2 ymm = 12 of the 16 ymm). Up to 3 rows (decode)
//   widen the codes as they read them, one row two tiles at a time (8 chains in flight, not
//   4); more rows widen a tile's group once into a 2 KB float32 block that every row reads
//   (the same float32 values, so the same bits).
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
// arithmetic of a row never depends on how many rows the call has (batch invariance by
// construction): every row sums a group in CHAINS = 2 partial sums (input i into chain
// i % 2, in input order), adds them chain 0 + chain 1, then acc += sum * scale and
// acc += xsum * offset, the same instructions in the same order at 1 row or 128. Rows
// only share the weights' conversion: 3 rows a pass (3 rows x 2 chains x 2 ymm = 12 of
// the 16 ymm, 2 for the weights, 1 for the broadcast x).
constexpr int CHAINS = 2;
constexpr int64_t AVX2_ROWS = 3;  // rows a pass over a group

// f(std::integral_constant<int, R>{}) for R = r, 1..AVX2_ROWS
template <typename F>
inline void with_avx2_rows(int64_t r, F&& f) {
  switch (r) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}

// a record's 16 scales and 16 offsets, two vectors each
template <int BITS, bool HALF>
inline void record_scales(const uint8_t* rec, __m256 (&s)[2], __m256 (&o)[2]) {
  if constexpr (!HALF) {
    const float* v = reinterpret_cast<const float*>(rec + code_bytes(BITS));
    s[0] = _mm256_loadu_ps(v);
    s[1] = _mm256_loadu_ps(v + 8);
    o[0] = _mm256_loadu_ps(v + 16);
    o[1] = _mm256_loadu_ps(v + 24);
  } else {
    const __m128i* h = reinterpret_cast<const __m128i*>(rec + code_bytes(BITS));
    s[0] = _mm256_cvtph_ps(_mm_loadu_si128(h));
    s[1] = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
    o[0] = _mm256_cvtph_ps(_mm_loadu_si128(h + 2));
    o[1] = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
  }
}

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

// R rows' products with one group into their accumulators; `codes(i, lo, hi)` gives input
// i's 16 weights as float32, xg the first row's inputs of the group (rows k apart), xs its
// sum of x over the group (rows `groups` apart)
template <int R, typename Codes>
inline void group_rows(Codes&& codes, const float* xg, int64_t k, const __m256 (&s)[2],
                       const __m256 (&o)[2], const float* xs, int64_t groups,
                       __m256 (&acc)[R][2]) {
  const float* row[R];  // each row's inputs of the group: R pointers in registers
  for (int r = 0; r < R; ++r) row[r] = xg + r * k;
  __m256 part[CHAINS][R][2];
  for (int p = 0; p < CHAINS; ++p)
    for (int r = 0; r < R; ++r) part[p][r][0] = part[p][r][1] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int i = 0; i < GROUP; ++i) {
    __m256 lo, hi;
    codes(i, lo, hi);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(row[r] + i);
      part[i % CHAINS][r][0] = _mm256_fmadd_ps(lo, x, part[i % CHAINS][r][0]);
      part[i % CHAINS][r][1] = _mm256_fmadd_ps(hi, x, part[i % CHAINS][r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 xsum = _mm256_broadcast_ss(xs + r * groups);
    for (int h = 0; h < 2; ++h) {
      const __m256 sum = _mm256_add_ps(part[0][r][h], part[1][r][h]);
      acc[r][h] = _mm256_fmadd_ps(sum, s[h], acc[r][h]);
      acc[r][h] = _mm256_fmadd_ps(xsum, o[h], acc[r][h]);
    }
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

// up to 3 rows (a decode step, a short verification) against one tile, the codes
// converted as they are read, the accumulators in registers
template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      const float* xsum, float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m256 s[2], o[2];
    record_scales<BITS, HALF>(rec, s, o);
    group_rows<R>([rec](int i, __m256& lo, __m256& hi) { record_codes<BITS>(rec, i, lo, hi); },
                  x + g * GROUP, k, s, o, xsum + g, groups, acc);
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], out + r * n_out, valid);
}

// one row (a decode step) against two tiles at once: 8 independent multiply-add chains (2
// tiles x 2 chains x 2 ymm) where one tile has 4, enough to cover the FMA latency. Each
// output's arithmetic is tile_rows<1>'s, instruction for instruction (the same chains in
// the same order, the scales read after them), so the bits are those of any other row count
template <int BITS, bool HALF>
inline void two_tiles_one_row(const uint8_t* first, const uint8_t* second, int64_t groups,
                              const float* x, const float* xsum, float* out_first,
                              float* out_second, int64_t valid_second) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  const uint8_t* rec[2] = {first, second};
  __m256 acc[2][2];
  for (int t = 0; t < 2; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec[0] += RB, rec[1] += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec[0] + 4 * RB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(rec[1] + 4 * RB), _MM_HINT_T0);
    __m256 part[CHAINS][2][2];
    for (int p = 0; p < CHAINS; ++p)
      for (int t = 0; t < 2; ++t) part[p][t][0] = part[p][t][1] = _mm256_setzero_ps();
    const float* xg = x + g * GROUP;
#pragma GCC unroll 32
    for (int i = 0; i < GROUP; ++i) {
      const __m256 xi = _mm256_broadcast_ss(xg + i);
      for (int t = 0; t < 2; ++t) {
        __m256 lo, hi;
        record_codes<BITS>(rec[t], i, lo, hi);
        part[i % CHAINS][t][0] = _mm256_fmadd_ps(lo, xi, part[i % CHAINS][t][0]);
        part[i % CHAINS][t][1] = _mm256_fmadd_ps(hi, xi, part[i % CHAINS][t][1]);
      }
    }
    const __m256 sum_x = _mm256_broadcast_ss(xsum + g);
    for (int t = 0; t < 2; ++t) {
      __m256 scale[2], offset[2];
      record_scales<BITS, HALF>(rec[t], scale, offset);
      for (int h = 0; h < 2; ++h) {
        const __m256 sum = _mm256_add_ps(part[0][t][h], part[1][t][h]);
        acc[t][h] = _mm256_fmadd_ps(sum, scale[h], acc[t][h]);
        acc[t][h] = _mm256_fmadd_ps(sum_x, offset[h], acc[t][h]);
      }
    }
  }
  store_row(acc[0], out_first, TILE);
  store_row(acc[1], out_second, valid_second);
}

template <int BITS, bool HALF>
void tiles_pass(const float* x, const float* xsum, int64_t rows, int64_t k, int64_t n,
                const uint8_t* packed, float* out, int64_t begin, int64_t end) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  const int64_t groups = k / GROUP, tile_bytes = groups * RB;
  if (rows == 0) return;
  int64_t t = begin;
  if (rows == 1)  // tiles two at a time; an odd one left goes below
    for (; t + 1 < end; t += 2)
      two_tiles_one_row<BITS, HALF>(packed + t * tile_bytes, packed + (t + 1) * tile_bytes,
                                    groups, x, xsum, out + t * TILE, out + (t + 1) * TILE,
                                    std::min(TILE, n - (t + 1) * TILE));
  if (rows <= AVX2_ROWS) {
    for (; t < end; ++t) {
      const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
      with_avx2_rows(rows, [&](auto r) {
        tile_rows<BITS, HALF, decltype(r)::value>(packed + t * tile_bytes, groups, x, k, xsum,
                                                  out + n0, n, valid);
      });
    }
    return;
  }
  // more rows: per tile and group, the codes converted to float32 once (2 KB, in L1), then
  // every row 3 at a time through the same group_rows, the accumulators kept per row in
  // `acc_rows` (float32 stores and loads: the same bits as in registers)
  alignas(32) float weights[GROUP * TILE];
  std::vector<float> acc_rows(rows * TILE);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    std::fill(acc_rows.begin(), acc_rows.end(), 0.f);
    const uint8_t* rec = packed + t * tile_bytes;
    for (int64_t g = 0; g < groups; ++g, rec += RB) {
      _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
      for (int i = 0; i < GROUP; ++i) {
        __m256 lo, hi;
        record_codes<BITS>(rec, i, lo, hi);
        _mm256_store_ps(weights + i * TILE, lo);
        _mm256_store_ps(weights + i * TILE + 8, hi);
      }
      __m256 s[2], o[2];
      record_scales<BITS, HALF>(rec, s, o);
      const auto from_weights = [&weights](int i, __m256& lo, __m256& hi) {
        lo = _mm256_load_ps(weights + i * TILE);
        hi = _mm256_load_ps(weights + i * TILE + 8);
        // in registers: loaded once for the 3 rows, not once a multiply-add (loads bound)
        __asm__("" : "+x"(lo), "+x"(hi));
      };
      for (int64_t m = 0; m < rows; m += AVX2_ROWS)
        with_avx2_rows(std::min(AVX2_ROWS, rows - m), [&](auto r) {
          constexpr int R = decltype(r)::value;
          float* kept = acc_rows.data() + m * TILE;
          __m256 acc[R][2];
          for (int j = 0; j < R; ++j)
            for (int h = 0; h < 2; ++h) acc[j][h] = _mm256_loadu_ps(kept + j * TILE + h * 8);
          group_rows<R>(from_weights, x + m * k + g * GROUP, k, s, o, xsum + m * groups + g,
                        groups, acc);
          for (int j = 0; j < R; ++j)
            for (int h = 0; h < 2; ++h) _mm256_storeu_ps(kept + j * TILE + h * 8, acc[j][h]);
        });
    }
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(out + m * n + n0, &acc_rows[m * TILE], valid * sizeof(float));
  }
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
