// Grouped int8 / 4-bit weights times int8 activations: the opt-in `activations: int8` mode
// of the grouped schemes, for prefills and batched decode (built with grouped_kernels.cpp).
//
// Each activation row is rounded per group of 32 inputs as llama.cpp's Q8_0 blocks are:
// d = amax / 127, q = round(x / d) in -127..127. Then, per output feature n and group g,
//
//   out[m, n] = sum_g d[m, g] * (scale[n, g] * sum_{i in g} code[n, i] * q[m, i]
//                                + offset[n, g] * sum_{i in g} q[m, i])
//
// which is the exact product of the rounded activations (q * d) with the weight
// (code * scale + offset), to float32 rounding. The integer sums run on AVX512-VNNI's
// `vpdpbusd` (64 byte products an instruction where a float32 FMA does 16): each record's
// 4 inputs x 16 outputs of codes are regrouped by one `vpermb` so that each 32-bit lane
// holds one output's 4 codes, and every activation row's 4 bytes are broadcast against
// them. vpdpbusd multiplies unsigned by signed bytes, so the codes are the unsigned side:
// 4-bit ones (0..15) as they are, int8 ones shifted by +128 (one xor per 4 inputs, shared
// by every row), whose 128 x sum q is taken back with the offset: scale * d * sum (code +
// 128) q + (offset - 128 scale) * d * sum q. With AVX2 and without VNNI, the same integer
// sums on vpmaddwd (8-bit codes) and vpmaddubsw (4-bit codes), the codes regrouped by byte
// unpacks (see that section); on any other CPU, the same arithmetic left to the compiler.
//
// Batch invariance: one row is rounded and multiplied as it is in any batch (its rounding
// is its own, per group; the integer sums are exact; per group acc += dot * (scale * d),
// then acc += d * sum q * offset, in that order), so a row's outputs are the same bits
// alone and beside any other rows, a decode step of 1 row included.
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "grouped_layout.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define COMPRESS_LM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define COMPRESS_LM_INT8_AVX2 1
#endif

namespace compress_lm {
namespace {

// rows x k activations rounded per group: int8 codes, each group's step d and d times the
// group's sum of codes; on the AVX2 path also each quad of codes as its multiplies read it
// (`quad_patterns`)
struct Rounded {
  std::vector<int8_t> codes;
  std::vector<float> step, step_sum;
  std::vector<int32_t> pairs;   // 8-bit weights: per quad two int32 (see quad_patterns)
  std::vector<int8_t> bytes;    // 4-bit weights: per quad 32 bytes
};

Rounded round_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  Rounded r{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
            std::vector<float>(rows * groups)};
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t rg = begin; rg < end; ++rg) {
      const float* xg = x + (rg / groups) * k + (rg % groups) * GROUP;
      float amax = 0.f;
      for (int i = 0; i < GROUP; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float d = amax / 127.f;
      int total = 0;
      int8_t* out = r.codes.data() + (rg / groups) * k + (rg % groups) * GROUP;
      for (int i = 0; i < GROUP; ++i) {
        const int q = d > 0.f ? static_cast<int>(std::nearbyint(xg[i] / d)) : 0;
        total += q;
        out[i] = static_cast<int8_t>(q);
      }
      r.step[rg] = d;
      r.step_sum[rg] = d * static_cast<float>(total);
    }
  });
  return r;
}

#if defined(COMPRESS_LM_VNNI)

// the vpermb index that turns 4 inputs x 16 outputs of codes into 16 lanes of 4 codes
inline __m512i quad_order(int bits) {
  alignas(64) uint8_t index[64];
  for (int j = 0; j < TILE; ++j)
    for (int b = 0; b < 4; ++b)  // at 4 bits: low nibbles, then high ones (see `quad`)
      index[4 * j + b] = static_cast<uint8_t>(
          bits == 8 ? 16 * b + j : (b % 2 ? 32 : 0) + (b / 2) * 16 + j);
  return _mm512_load_si512(index);
}

// codes of inputs 4p..4p+3 of the record's 16 outputs, one output a 32-bit lane, as
// unsigned bytes (int8 codes + 128)
template <int BITS>
inline __m512i quad(const uint8_t* codes, int p, __m512i order) {
  if constexpr (BITS == 8) {
    const __m512i shifted = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * p),
                                             _mm512_set1_epi8(static_cast<char>(0x80)));
    return _mm512_permutexvar_epi8(order, shifted);
  } else {
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * p));
    const __m256i low = _mm256_set1_epi8(15);
    const __m512i split = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(both, low)),
        _mm256_and_si256(_mm256_srli_epi16(both, 4), low), 1);
    return _mm512_permutexvar_epi8(order, split);
  }
}

template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* q, int64_t k,
                      const float* step, const float* step_sum, float* out, int64_t n_out,
                      int64_t valid, __m512i order) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int8_t* qg = q + g * GROUP;
#pragma GCC unroll 8
    for (int p = 0; p < GROUP / 4; ++p) {
      const __m512i w = quad<BITS>(rec, p, order);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, qg + r * k + 4 * p, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(four));
      }
    }
    __m512 s, o;
    record_scales<BITS, HALF>(rec, s, o);
    if constexpr (BITS == 8) o = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, o);
    for (int r = 0; r < R; ++r) {
      const __m512 scaled = _mm512_mul_ps(s, _mm512_set1_ps(step[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scaled, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(step_sum[r * groups + g]), o, acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * n_out, keep, acc[r]);
}

#elif defined(COMPRESS_LM_INT8_AVX2)

// AVX2 without VNNI: the integer sums on vpmaddwd (8-bit weights: 16-bit products summed in
// pairs into 32-bit lanes) and vpmaddubsw (4-bit weights: unsigned codes 0..15 times signed
// activation bytes, summed in pairs into 16-bit lanes, which hold a whole group: 8 quads x 2
// x 15 x 127 = 30480 < 32767, so no saturation). The record's codes (16 outputs' codes of
// input i side by side) are regrouped per quad of inputs 4p..4p+3 by two byte unpacks shared
// by every row: 8-bit, inputs (4p, 4p+2) of outputs 0-7 in one half and (4p+1, 4p+3) in the
// other; 4-bit, the low and high nibbles of byte rows 2p and 2p+1 interleaved, inputs
// (4p, 4p+1) of outputs 0-7 in one half and (4p+2, 4p+3) in the other. Each row's
// activation codes come arranged to match (`quad_patterns`, once a call).

constexpr int64_t INT8_AVX2_ROWS = 3;    // rows a pass: 3 x (2 sums + 2 accumulators) ymm

// the activation codes of every row arranged for the products: 8-bit weights, per quad
// (q0..q3 = inputs 4p..4p+3) the 16-bit pairs (q0, q2) and (q1, q3) as two int32, each
// broadcast; 4-bit weights, per quad 32 bytes, (q0, q1) eight times then (q2, q3) eight times
void quad_patterns(Rounded& r, int64_t rows, int64_t k, int bits) {
  const int64_t quads = rows * k / 4;
  const auto pair = [](int8_t a, int8_t b) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(int16_t{a})) |
                                (static_cast<uint32_t>(static_cast<uint16_t>(int16_t{b})) << 16));
  };
  if (bits == 8) {
    r.pairs.resize(2 * quads);
    for (int64_t u = 0; u < quads; ++u) {
      const int8_t* q = r.codes.data() + 4 * u;
      r.pairs[2 * u] = pair(q[0], q[2]);
      r.pairs[2 * u + 1] = pair(q[1], q[3]);
    }
  } else {
    r.bytes.resize(32 * quads);
    for (int64_t u = 0; u < quads; ++u) {
      const int8_t* q = r.codes.data() + 4 * u;
      int8_t* out = r.bytes.data() + 32 * u;
      for (int m = 0; m < 8; ++m) {
        out[2 * m] = q[0];
        out[2 * m + 1] = q[1];
        out[16 + 2 * m] = q[2];
        out[16 + 2 * m + 1] = q[3];
      }
    }
  }
}

// the two halves of 16 bytes, each widened to 16 int16
inline void widen_halves(__m256i v, __m256i& low, __m256i& high) {
  low = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
  high = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

// 16 int16 sums (one half outputs 0-7 over two inputs, the other the same outputs over two
// more) as 8 int32 sums of the outputs
inline __m256i fold_halves(__m256i v) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

// R rows from row `first` (their codes' quads at `x`'s patterns) against one tile
template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const Rounded& x, int64_t first,
                      int64_t k, float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  const int64_t row_quads = k / 4;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    if constexpr (BITS == 8) {
      const int32_t* pairs = x.pairs.data() + 2 * (first * row_quads + g * QUADS);
#pragma GCC unroll 8
      for (int p = 0; p < QUADS; ++p) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p));
        const __m256i b =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * p + 32));
        __m256i e0, e1, f0, f1;  // outputs 0-7 and 8-15, inputs (4p, 4p+2) and (4p+1, 4p+3)
        widen_halves(_mm256_unpacklo_epi8(a, b), e0, e1);
        widen_halves(_mm256_unpackhi_epi8(a, b), f0, f1);
        for (int r = 0; r < R; ++r) {
          const int32_t* pr = pairs + 2 * (r * row_quads + p);
          const __m256i q02 = _mm256_set1_epi32(pr[0]), q13 = _mm256_set1_epi32(pr[1]);
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_add_epi32(_mm256_madd_epi16(e0, q02),
                                                                   _mm256_madd_epi16(e1, q13)));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_add_epi32(_mm256_madd_epi16(f0, q02),
                                                                   _mm256_madd_epi16(f1, q13)));
        }
      }
    } else {
      const int8_t* bytes = x.bytes.data() + 32 * (first * row_quads + g * QUADS);
      const __m256i nibble = _mm256_set1_epi8(15);
#pragma GCC unroll 8
      for (int p = 0; p < QUADS; ++p) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * p));
        const __m256i low = _mm256_and_si256(both, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
        const __m256i e = _mm256_unpacklo_epi8(low, high), f = _mm256_unpackhi_epi8(low, high);
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(bytes + 32 * (r * row_quads + p)));
          dot[r][0] = _mm256_add_epi16(dot[r][0], _mm256_maddubs_epi16(e, q));
          dot[r][1] = _mm256_add_epi16(dot[r][1], _mm256_maddubs_epi16(f, q));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) dot[r][h] = fold_halves(dot[r][h]);
    }
    __m256 s[2], o[2];
    record_scales<BITS, HALF>(rec, s, o);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * groups + g;
      const __m256 d = _mm256_set1_ps(x.step[at]), ds = _mm256_set1_ps(x.step_sum[at]);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(s[h], d),
                                    acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(ds, o[h], acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[TILE];
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    std::memcpy(out + r * n_out, row, valid * sizeof(float));
  }
}

template <int BITS, bool HALF>
void tiles_pass(const Rounded& x, int64_t rows, int64_t k, int64_t n, const uint8_t* packed,
                float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP, tile_bytes = groups * record_bytes(BITS, HALF);
  const int64_t passes = (rows + INT8_AVX2_ROWS - 1) / INT8_AVX2_ROWS;
  const int64_t per_pass = passes ? (rows + passes - 1) / passes : 0;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    for (int64_t m = 0; m < rows; m += per_pass) {
      with_rows(std::min(per_pass, rows - m), [&](auto r) {  // at most INT8_AVX2_ROWS
        tile_rows<BITS, HALF, decltype(r)::value>(packed + t * tile_bytes, groups, x, m, k,
                                                  out + m * n + n0, n, valid);
      });
    }
  }
}

#else  // portable: the same integer arithmetic, left to the compiler to vectorize

using Order = int;
inline Order quad_order(int) { return 0; }

template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const int8_t* q, int64_t k,
                      const float* step, const float* step_sum, float* out, int64_t n_out,
                      int64_t valid, Order) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  float acc[R][TILE] = {};
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    int32_t dot[R][TILE] = {};
    const int8_t* qg = q + g * GROUP;
    for (int i = 0; i < GROUP; ++i) {
      int32_t w[TILE];
      for (int j = 0; j < TILE; ++j) {
        if constexpr (BITS == 8) {
          w[j] = static_cast<int8_t>(rec[i * TILE + j]);
        } else {
          const uint8_t both = rec[(i / 2) * TILE + j];
          w[j] = i % 2 ? both >> 4 : both & 15;
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t a = qg[r * k + i];
        for (int j = 0; j < TILE; ++j) dot[r][j] += w[j] * a;
      }
    }
    float scale[2 * TILE];
    record_scales<BITS, HALF>(rec, scale);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < TILE; ++j)
        acc[r][j] += static_cast<float>(dot[r][j]) * (scale[j] * step[r * groups + g]) +
                     step_sum[r * groups + g] * scale[TILE + j];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < valid; ++j) out[r * n_out + j] = acc[r][j];
}

#endif

#if !defined(COMPRESS_LM_INT8_AVX2)
template <int BITS, bool HALF>
void tiles_pass(const Rounded& x, int64_t rows, int64_t k, int64_t n, const uint8_t* packed,
                float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP, tile_bytes = groups * record_bytes(BITS, HALF);
  const auto order = quad_order(BITS);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    const uint8_t* rec = packed + t * tile_bytes;
    for (int64_t m = 0; m < rows; m += ROWS) {
      const int8_t* q = x.codes.data() + m * k;
      const float *d = x.step.data() + m * groups, *ds = x.step_sum.data() + m * groups;
      float* o = out + m * n + n0;
      with_rows(std::min(ROWS, rows - m), [&](auto r) {
        tile_rows<BITS, HALF, decltype(r)::value>(rec, groups, q, k, d, ds, o, n, valid, order);
      });
    }
  }
}
#endif

at::Tensor grouped_mm_int8(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           int64_t bits, bool half) {
  const at::Tensor x2 = product_rows(x, packed, n, bits, half, "grouped_mm_int8");
  const int64_t k = x2.size(1), rows = x2.size(0), tiles = (n + TILE - 1) / TILE;
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor out = at::empty({rows, n}, x.options());
  Rounded rounded = round_rows(x2.data_ptr<float>(), rows, k);
#if defined(COMPRESS_LM_INT8_AVX2)
  quad_patterns(rounded, rows, k, static_cast<int>(bits));
#endif
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    with_layout(bits, half, [&](auto b, auto h) {
      tiles_pass<decltype(b)::value, decltype(h)::value>(rounded, rows, k, n, pp, yp, begin, end);
    });
  });
  return out.view(out_shape);
}

}  // namespace
}  // namespace compress_lm

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("grouped_mm_int8", &compress_lm::grouped_mm_int8);
}
