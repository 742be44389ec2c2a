// Bidirectional attention for encoders (encoder_attention.py registers and documents it):
// softmax(q k^T * scale + mask) v with q, k, v (B, H, L, D), unit stride along D, and the
// answer laid out (B, L, H, D). A task is one block of 32 query rows of one (batch, head);
// a thread lays out each (batch, head)'s k and v once for its tasks. Three paths:
// AVX512-BF16 (heads of 16, 32, 64): both products on bfloat16 pairs (vdpbf16ps), float32
// sums, softmax and output; AVX-512: float32 register blocks; else plain float32 loops.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdlib>
#include <vector>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;    // query rows a register block
constexpr int64_t kBlock = 32;  // query rows a task

#ifdef __AVX512F__
inline __m512 exp512(__m512 x) {  // exp(x) for x <= 0, ~1 ulp over softmax's range
  const __m512 lo = _mm512_set1_ps(-87.0f);
  x = _mm512_max_ps(x, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// scores[r][0..Sp) = q_r . k_j for r < rows (rows <= kRows); kt is k transposed, (D, Sp)
void scores_block(const float* q, int64_t q_stride, int64_t rows, const float* kt, int64_t D,
                  int64_t Sp, float* scores) {
#ifdef __AVX512F__
  const float* qr[kRows];
  for (int r = 0; r < kRows; ++r) qr[r] = q + std::min<int64_t>(r, rows - 1) * q_stride;
  for (int64_t j = 0; j < Sp; j += 32) {
    const bool two = j + 16 < Sp;
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* col = kt + j;
    for (int64_t d = 0; d < D; ++d, col += Sp) {
      __m512 k0 = _mm512_loadu_ps(col);
      __m512 k1 = two ? _mm512_loadu_ps(col + 16) : _mm512_setzero_ps();
      for (int r = 0; r < kRows; ++r) {
        __m512 qv = _mm512_set1_ps(qr[r][d]);
        acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      _mm512_storeu_ps(scores + r * Sp + j, acc[r][0]);
      if (two) _mm512_storeu_ps(scores + r * Sp + j + 16, acc[r][1]);
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < Sp; ++j) {
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) sum += q[r * q_stride + d] * kt[d * Sp + j];
      scores[r * Sp + j] = sum;
    }
#endif
}

// A query row's mask: floats added to its scores, or bools (false masks), or neither.
struct MaskRow {
  const float* add = nullptr;
  const bool* keep = nullptr;
};

// row = exp(row * scale + mask - max), zero past S; returns the sum
float softmax_row(float* row, MaskRow mask, int64_t S, int64_t Sp, float scale) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float top = -std::numeric_limits<float>::infinity();
  int64_t j0 = 0;
#ifdef __AVX512F__
  {
    __m512 best = _mm512_set1_ps(top);
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (; j0 + 16 <= S; j0 += 16) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + j0), scale_v);
      if (mask.add) x = _mm512_add_ps(x, _mm512_loadu_ps(mask.add + j0));
      if (mask.keep) {  // 16 bools: lanes whose byte is 0 become -inf
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mask.keep + j0));
        x = _mm512_mask_blend_ps(_mm_cmpneq_epi8_mask(bytes, _mm_setzero_si128()),
                                 _mm512_set1_ps(kNone), x);
#else
        break;  // the plain loop below masks them
#endif
      }
      _mm512_storeu_ps(row + j0, x);
      best = _mm512_max_ps(best, x);
    }
    top = _mm512_reduce_max_ps(best);
  }
#endif
  for (int64_t j = j0; j < S; ++j) {
    row[j] = mask.keep && !mask.keep[j] ? kNone : row[j] * scale + (mask.add ? mask.add[j] : 0.f);
    top = std::max(top, row[j]);
  }
  if (top == kNone) {
    for (int64_t j = 0; j < Sp; ++j) row[j] = 0.f;
    return 0.f;
  }
  float sum = 0.f;
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 total = _mm512_setzero_ps();
  const __m512 top_v = _mm512_set1_ps(top);
  for (; j + 16 <= S; j += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), top_v));
    _mm512_storeu_ps(row + j, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; j < S; ++j) {
    row[j] = std::exp(row[j] - top);
    sum += row[j];
  }
  for (j = S; j < Sp; ++j) row[j] = 0.f;
  return sum;
}

// out[r][0..16 * kVecs) = sum_j p[r][j] v[j] / sums[r], rows <= kRows
#ifdef __AVX512F__
template <int kVecs>
void weighted_block(const float* p, int64_t Sp, int64_t S, int64_t rows, const float* v,
                    int64_t v_stride, const float* sums, float* out, int64_t out_stride) {
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* pr[kRows];  // rows past `rows` read row 0 and are not stored
  for (int r = 0; r < kRows; ++r) pr[r] = p + (r < rows ? r : 0) * Sp;
  for (int64_t j = 0; j < S; ++j, v += v_stride) {
    __m512 vv[kVecs];
    for (int c = 0; c < kVecs; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      __m512 w = _mm512_set1_ps(pr[r][j]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    __m512 inv = _mm512_set1_ps(sums[r] > 0.f ? 1.f / sums[r] : 0.f);
    for (int c = 0; c < kVecs; ++c)
      _mm512_storeu_ps(out + r * out_stride + 16 * c, _mm512_mul_ps(acc[r][c], inv));
  }
}
#endif

void weighted_values(const float* p, int64_t Sp, int64_t S, int64_t rows, const float* v,
                     int64_t v_stride, int64_t D, const float* sums, float* out,
                     int64_t out_stride) {
#ifdef __AVX512F__
  if (D == 16 || D == 32) {
    for (int64_t r = 0; r < rows; r += kRows) {
      const int64_t nr = std::min(kRows, rows - r);
      const float* pr = p + r * Sp;
      float* o = out + r * out_stride;
      switch (D / 16) {
        case 1: weighted_block<1>(pr, Sp, S, nr, v, v_stride, sums + r, o, out_stride); break;
        case 2: weighted_block<2>(pr, Sp, S, nr, v, v_stride, sums + r, o, out_stride); break;
                default: weighted_block<2>(pr, Sp, S, nr, v, v_stride, sums + r, o, out_stride);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < S; ++j) acc += p[r * Sp + j] * v[j * v_stride + d];
      out[r * out_stride + d] = acc * inv;
    }
  }
}

#ifdef __AVX512BF16__
// q k^T and p v on bfloat16 pairs (vdpbf16ps), softmax in float32. Layouts, 32-bit words
// of two bfloat16: kp[t][j] = (k[j][2t], k[j][2t+1]), vp[u][d] = (v[2u][d], v[2u+1][d]),
// a q or p row's word t = its elements 2t, 2t+1.
inline uint32_t bf16_bits(float x) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

void to_bf16_scaled(const float* x, int64_t n, float by, uint16_t* out) {  // x * by
  const __m512 by_v = _mm512_set1_ps(by);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i), by_v)));
  for (; i < n; ++i) out[i] = (uint16_t)bf16_bits(x[i] * by);
}

// 16 words of two bfloat16 from 32 floats at x (words = 8: 16 floats, the rest zero)
inline __m512i key_words(const float* x, int64_t words) {
  if (words < 16)
    return _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

// r[i][l] <- r[l][i]: a 16 x 16 tile of 32-bit words transposed in registers
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xDD);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xDD);
  }
}

constexpr float kLog2e = 1.44269504089f;

// 2^x for x <= 0: 2^n times a degree-3 polynomial of x - n, n the nearest integer, its
// relative error below 2e-4 (a sixth of a bfloat16's rounding, what the weights round to);
// -inf gives 2^-126 (~1e-38: no weight next to a row's largest, which is 1)
inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.58755351e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.42294631e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93127263e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99948234e-1f));
  return _mm512_scalef_ps(p, n);
}

// 16 scores from key j on: the mask applied (bools: -inf where false; floats: added, in
// log2 units), -inf from key S on
inline __m512 masked_scores(__m512 x, const MaskRow& mask, int64_t j, int64_t S) {
  const int64_t left = S - j;
  const __mmask16 valid = left >= 16 ? (__mmask16)0xffff
                                     : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
  if (mask.add)
    x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(valid, mask.add + j), _mm512_set1_ps(kLog2e), x);
  __mmask16 keep = valid;
  if (mask.keep)
    keep &= _mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(valid, mask.keep + j),
                                 _mm_setzero_si128());
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), x);
}

// prow = bfloat16 of 2^(row - max); returns the float sums, 16 lanes (0 where every key
// is masked)
inline __m512 exp2_row(const float* row, float top, int64_t Sp, uint16_t* prow) {
  __m512 total = _mm512_setzero_ps();
  if (top == -INFINITY) {
    std::memset(prow, 0, Sp * sizeof(uint16_t));
    return total;
  }
  const __m512 top_v = _mm512_set1_ps(top);
  for (int64_t j = 0; j < Sp; j += 16) {
    const __m512 e = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(row + j), top_v));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return total;
}

// out[r] = the sum (or the largest) of v[r]'s 16 lanes, for the 8 rows of a register block
// at once: halves folded across rows in shuffles, a third of the work of 8 reductions
template <bool kMax>
inline void reduce_rows(const __m512* v, float* out) {
  auto op = [](__m512 a, __m512 b) { return kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  __m512 pair[4], quad[2];
  for (int i = 0; i < 4; ++i)  // rows 2i, 2i+1: two 128-bit partials each
    pair[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                 _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lane l: row 4i + l's four partials
    quad[i] = op(_mm512_shuffle_f32x4(pair[2 * i], pair[2 * i + 1], 0x88),
                 _mm512_shuffle_f32x4(pair[2 * i], pair[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {
    __m512 x = op(quad[i], _mm512_permute_ps(quad[i], 0x4E));
    x = op(x, _mm512_permute_ps(x, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, x);
    for (int l = 0; l < 4; ++l) out[4 * i + l] = lanes[4 * l];
  }
}

template <int kVecs>  // D / 16: float32 vectors of a head's output row
void attention_bf16(const float* qb, int64_t qs, const float* kb, int64_t ks, const float* vb,
                    int64_t vs, const MaskRow* mask_rows, int64_t rows, int64_t S,
                    float scale, uint32_t* kp, uint32_t* vp, bool pack,
                    float* scores, uint16_t* prow, float* sums, float* out,
                    int64_t out_stride) {
  constexpr int64_t D = 16 * kVecs, T = D / 2;
  const int64_t Sp = (S + 31) / 32 * 32, U = Sp / 2;
  if (pack) {
    for (int64_t j0 = 0; j0 < Sp; j0 += 16)  // 16 keys' words a tile, transposed in registers
      for (int64_t w0 = 0; w0 < T; w0 += 16) {
        __m512i tile[16];
        for (int i = 0; i < 16; ++i)
          tile[i] = j0 + i < S ? key_words(kb + (j0 + i) * ks + 2 * w0, T - w0)
                               : _mm512_setzero_si512();
        transpose16(tile);
        for (int64_t t = 0; t < std::min<int64_t>(16, T - w0); ++t)
          _mm512_storeu_si512(kp + (w0 + t) * Sp + j0, tile[t]);
      }
    // (v[2u][d], v[2u+1][d]): both rows rounded in one conversion, their halves interleaved
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    for (int64_t u = 0; u < U; ++u) {
      for (int c = 0; c < kVecs; ++c) {
        const __m512 even = 2 * u < S ? _mm512_loadu_ps(vb + 2 * u * vs + 16 * c)
                                      : _mm512_setzero_ps();
        const __m512 odd = 2 * u + 1 < S ? _mm512_loadu_ps(vb + (2 * u + 1) * vs + 16 * c)
                                         : _mm512_setzero_ps();
        _mm512_storeu_si512(vp + u * D + 16 * c, _mm512_permutexvar_epi16(
            pairs, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
      }
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    uint32_t qw[kRows][T];
    for (int r = 0; r < kRows; ++r)  // q scaled to log2 units: softmax runs on 2^x
      to_bf16_scaled(qb + std::min<int64_t>(r0 + r, rows - 1) * qs, D, scale * kLog2e,
                     reinterpret_cast<uint16_t*>(qw[r]));
    __m512 best[kRows];
    for (int r = 0; r < kRows; ++r) best[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Sp; j += 32) {
      __m512 acc[kRows][2];
      for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t t = 0; t < T; ++t) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + t * Sp + j);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + t * Sp + j + 16);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qw[r][t]);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        if (r >= nr) break;
        const __m512 a0 = masked_scores(acc[r][0], mask_rows[r0 + r], j, S);
        const __m512 a1 = masked_scores(acc[r][1], mask_rows[r0 + r], j + 16, S);
        _mm512_storeu_ps(scores + r * Sp + j, a0);
        _mm512_storeu_ps(scores + r * Sp + j + 16, a1);
        best[r] = _mm512_max_ps(best[r], _mm512_max_ps(a0, a1));
      }
    }
    static_assert(kRows == 8, "reduce_rows folds 8 rows");
    float tops[kRows];
    reduce_rows<true>(best, tops);
    __m512 totals[kRows];
    for (int r = 0; r < kRows; ++r)
      totals[r] = r < nr ? exp2_row(scores + r * Sp, tops[r], Sp, prow + r * Sp)
                         : _mm512_setzero_ps();
    reduce_rows<false>(totals, sums);
    __m512 acc[kRows][kVecs];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint32_t* pw[kRows];
    for (int r = 0; r < kRows; ++r)
      pw[r] = reinterpret_cast<const uint32_t*>(prow + (r < nr ? r : 0) * Sp);
    for (int64_t u = 0; u < U; ++u) {
      __m512bh vv[kVecs];
      for (int c = 0; c < kVecs; ++c)
        vv[c] = (__m512bh)_mm512_loadu_si512(vp + u * D + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[r][u]);
#pragma GCC unroll 4
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, vv[c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      if (r >= nr) break;
      __m512 inv = _mm512_set1_ps(sums[r] > 0.f ? 1.f / sums[r] : 0.f);
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c)
        _mm512_storeu_ps(out + (r0 + r) * out_stride + 16 * c, _mm512_mul_ps(acc[r][c], inv));
    }
  }
}
#endif

// n where keep[0, n) are all true and keep[n, S) all false, else -1
int64_t kept_prefix(const bool* keep, int64_t S) {
  int64_t n = 0;
  while (n < S && keep[n]) ++n;
  for (int64_t j = n; j < S; ++j)
    if (keep[j]) return -1;
  return n;
}

// One thread's buffers for sequences of up to S keys of heads of D.
struct Scratch {
  std::vector<float> kt, scores, sums, gathered, block;
  std::vector<uint32_t> kpw, vpw;
  std::vector<uint16_t> prow;
  Scratch(int64_t S, int64_t D, bool use_bf16, bool gather, bool quantized) {
    block.resize(quantized ? kBlock * D : 0);
    const int64_t Sp = (S + 15) / 16 * 16, Sp32 = (S + 31) / 32 * 32;
    kt.resize(use_bf16 ? 0 : D * Sp);
    scores.resize(kBlock * Sp32);
    sums.resize(kBlock);
    gathered.resize(gather ? kBlock * S : 0);
    kpw.resize(use_bf16 ? D / 2 * Sp32 : 0);
    vpw.resize(use_bf16 ? Sp32 / 2 * D : 0);
    prow.resize(use_bf16 ? kBlock * Sp32 : 0);
  }
};

// Where a quantized answer goes: the next int8 linear's uint8 input, clamp(rint(y * smooth /
// scale) + zero_point) of each answer y, smooth SmoothQuant's multiply of each of the H * D
// features (null: none); data null: the answer stays float32.
struct QuantizedAnswer {
  uint8_t* data = nullptr;
  at::Tensor factors;  // holds smooth
  const float* smooth = nullptr;
  float inv_scale = 1.f, zero_point = 0.f, lo = 0.f, hi = 255.f;

  // rows x D answers of head h, `block` one row after another, to rows `stride` apart
  void store(const float* block, int64_t rows, int64_t D, int64_t h, uint8_t* out,
             int64_t stride) const {
    const float* by = smooth ? smooth + h * D : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const float* y = block + r * D;
      uint8_t* q = out + r * stride;
      int64_t d = 0;
#ifdef __AVX512F__
      const __m512 inv = _mm512_set1_ps(inv_scale), zp = _mm512_set1_ps(zero_point);
      for (; d + 16 <= D; d += 16) {
        __m512 v = _mm512_loadu_ps(y + d);
        if (by) v = _mm512_mul_ps(v, _mm512_loadu_ps(by + d));
        v = _mm512_add_ps(_mm512_roundscale_ps(_mm512_mul_ps(v, inv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                          zp);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
      }
#endif
      for (; d < D; ++d) {
        const float t = std::nearbyint((by ? y[d] * by[d] : y[d]) * inv_scale) + zero_point;
        q[d] = static_cast<uint8_t>(std::fmin(std::fmax(t, lo), hi));
      }
    }
  }
};

// softmax(q k^T * scale + mask) v for `rows` (<= kBlock) query rows of one (sequence, head)
// over its S keys, written with `out_stride` between rows; its k (and v) laid out in `w`
// first where `pack` (the thread's previous block was of another sequence or head)
void attend(const float* qb, int64_t qs, const float* kb, int64_t ks, const float* vb,
            int64_t vs, int64_t D, const MaskRow* mask_rows, int64_t rows, int64_t S,
            float scale, bool pack, bool use_bf16, Scratch& w, float* ob,
            int64_t out_stride) {
#ifdef __AVX512BF16__
  if (use_bf16) {
    auto run = D == 16 ? attention_bf16<1> : D == 32 ? attention_bf16<2> : attention_bf16<4>;
    run(qb, qs, kb, ks, vb, vs, mask_rows, rows, S, scale, w.kpw.data(), w.vpw.data(), pack,
        w.scores.data(), w.prow.data(), w.sums.data(), ob, out_stride);
    return;
  }
#endif
  const int64_t Sp = (S + 15) / 16 * 16;
  if (pack)  // k^T for this (sequence, head), zero past S
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < S; ++j) w.kt[d * Sp + j] = kb[j * ks + d];
      for (int64_t j = S; j < Sp; ++j) w.kt[d * Sp + j] = 0.f;
    }
  for (int64_t r = 0; r < rows; r += kRows)
    scores_block(qb + r * qs, qs, std::min(kRows, rows - r), w.kt.data(), D, Sp,
                 w.scores.data() + r * Sp);
  for (int64_t r = 0; r < rows; ++r)
    w.sums[r] = softmax_row(w.scores.data() + r * Sp, mask_rows[r], S, Sp, scale);
  weighted_values(w.scores.data(), Sp, S, rows, vb, vs, D, w.sums.data(), ob, out_stride);
}

bool bf16_head(int64_t D) {
#ifdef __AVX512BF16__
  return D == 16 || D == 32 || D == 64;
#else
  return false;
#endif
}

// Rows x D answers of head h for the answer's rows from `token` on: attend() writes them
// in place, or to the thread's block and then quantized (quant.data set)
struct AnswerRows {
  float* out;
  QuantizedAnswer quant;
  int64_t H, D;
  float* where(Scratch& w, int64_t token, int64_t h) const {
    return quant.data ? w.block.data() : out + (token * H + h) * D;
  }
  int64_t stride() const { return quant.data ? D : H * D; }
  void done(Scratch& w, int64_t token, int64_t h, int64_t rows) const {
    if (quant.data)
      quant.store(w.block.data(), rows, D, h, quant.data + (token * H + h) * D, H * D);
  }
};

// An answer of `shape`: float32, or uint8 where `quant` is given (its data set to it)
at::Tensor answer_tensor(at::IntArrayRef shape, const at::Tensor& like, QuantizedAnswer* quant) {
  if (!quant) return at::empty(shape, like.options());
  auto out = at::empty(shape, like.options().dtype(at::kByte));
  quant->data = out.data_ptr<uint8_t>();
  return out;
}

at::Tensor attention_into(const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const std::optional<at::Tensor>& mask,
                          double scale, QuantizedAnswer* quant) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "encoder_attention: q, k, v must be (batch, heads, length, head_dim)");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "encoder_attention: float32 only");
  auto q = query.stride(3) == 1 ? query : query.contiguous();
  auto k = key.stride(3) == 1 ? key : key.contiguous();
  auto v = value.stride(3) == 1 ? value : value.contiguous();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  // the mask as a (B, H, L, S) view: bool (true keeps) or float (added to the scores)
  at::Tensor masks;
  if (mask.has_value() && mask->defined())
    masks = (mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat))
                .expand({B, H, L, S});
  const bool bool_mask = masks.defined() && masks.scalar_type() == at::kBool;
  auto out = answer_tensor({B, L, H, D}, q, quant);
  const AnswerRows answer{quant ? nullptr : out.data_ptr<float>(),
                          quant ? *quant : QuantizedAnswer{}, H, D};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = masks.defined() && !bool_mask ? masks.data_ptr<float>() : nullptr;
  const bool* keep = bool_mask ? masks.data_ptr<bool>() : nullptr;
  const int64_t blocks = (L + kBlock - 1) / kBlock;
  const bool use_bf16 = bf16_head(D);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  int64_t ms[4] = {0, 0, 0, 0};
  if (masks.defined()) for (int i = 0; i < 4; ++i) ms[i] = masks.stride(i);
  // a bool mask that does not vary along the queries, contiguous along the keys
  const bool padding_mask = bool_mask && ms[2] == 0 && ms[3] == 1;
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    // mask rows as floats where the mask is strided along the keys
    Scratch w(S, D, use_bf16, masks.defined() && ms[3] != 1, quant != nullptr);
    int64_t packed = -1;  // the (batch, head) whose k (and v) are laid out
    int64_t prefix = -1;  // its padding mask's kept keys (-1: not a prefix)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, blk = task % blocks, b = bh / H, h = bh % H;
      const int64_t i0 = blk * kBlock, rows = std::min(kBlock, L - i0);
      const bool pack = packed != bh;
      packed = bh;
      // a padding mask (the same keys kept for every query) that keeps a prefix of the keys:
      // on the bf16 path the keys past it are left out, and no mask is read
      if (pack)
        prefix = use_bf16 && padding_mask ? kept_prefix(keep + b * ms[0] + h * ms[1], S) : -1;
      MaskRow mask_rows[kBlock];
      for (int64_t r = 0; r < rows && masks.defined() && prefix < 0; ++r) {
        const int64_t base = b * ms[0] + h * ms[1] + (i0 + r) * ms[2];
        if (ms[3] == 1) {
          mask_rows[r] = keep ? MaskRow{nullptr, keep + base} : MaskRow{mp + base, nullptr};
          continue;
        }
        float* row = w.gathered.data() + r * S;  // strided along the keys: gathered as floats
        for (int64_t j = 0; j < S; ++j)
          row[j] = keep ? (keep[base + j * ms[3]] ? 0.f : -INFINITY) : mp[base + j * ms[3]];
        mask_rows[r] = MaskRow{row, nullptr};
      }
      attend(qp + b * qs0 + h * qs1 + i0 * qs2, qs2, kp + b * ks0 + h * ks1, ks2,
             vp + b * vs0 + h * vs1, vs2, D, mask_rows, rows, prefix >= 0 ? prefix : S,
             (float)scale, pack, use_bf16, w, answer.where(w, b * L + i0, h), answer.stride());
      answer.done(w, b * L + i0, h, rows);
    }
  });
  return out;
}

// Attention within each of the sequences packed one after another along the length of q,
// k, v (1, H, T, D): sequence s holds positions [offsets[s], offsets[s + 1]), and its
// queries see its own keys only. The answer is laid out (1, T, H, D). A task is one block of
// query rows of one (sequence, head).
at::Tensor packed_attention_into(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& offsets,
                                 double scale, QuantizedAnswer* quant) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1,
              "packed_attention: q, k, v must be (1, heads, tokens, head_dim)");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "packed_attention: float32 only");
  auto q = query.stride(3) == 1 ? query : query.contiguous();
  auto k = key.stride(3) == 1 ? key : key.contiguous();
  auto v = value.stride(3) == 1 ? value : value.contiguous();
  const int64_t H = q.size(1), T = q.size(2), D = q.size(3);
  auto bounds = offsets.to(at::kLong).contiguous();
  const int64_t* o = bounds.data_ptr<int64_t>();
  const int64_t count = bounds.numel() - 1;
  TORCH_CHECK(count >= 0 && (count == 0 || (o[0] == 0 && o[count] == T)),
              "packed_attention: offsets must run from 0 to the token count");
  // the first task of each sequence (its blocks of every head), and the longest sequence
  std::vector<int64_t> first(count + 1, 0);
  int64_t longest = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t n = o[s + 1] - o[s];
    TORCH_CHECK(n >= 0, "packed_attention: offsets must not decrease");
    longest = std::max(longest, n);
    first[s + 1] = first[s] + H * ((n + kBlock - 1) / kBlock);
  }
  auto out = answer_tensor({1, T, H, D}, q, quant);
  const AnswerRows answer{quant ? nullptr : out.data_ptr<float>(),
                          quant ? *quant : QuantizedAnswer{}, H, D};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool use_bf16 = bf16_head(D);
  const int64_t qs1 = q.stride(1), qs2 = q.stride(2), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, first[count], 1, [&](int64_t begin, int64_t end) {
    Scratch w(std::max<int64_t>(longest, 1), D, use_bf16, false, quant != nullptr);
    MaskRow mask_rows[kBlock];  // none: a sequence's own keys are all kept
    int64_t s = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    int64_t packed = -1;  // the (sequence, head) whose k (and v) are laid out
    for (int64_t task = begin; task < end; ++task) {
      while (task >= first[s + 1]) ++s;
      const int64_t n = o[s + 1] - o[s], blocks = (n + kBlock - 1) / kBlock;
      const int64_t h = (task - first[s]) / blocks, blk = (task - first[s]) % blocks;
      const int64_t i0 = o[s] + blk * kBlock, rows = std::min(kBlock, o[s + 1] - i0);
      const bool pack = packed != s * H + h;
      packed = s * H + h;
      attend(qp + h * qs1 + i0 * qs2, qs2, kp + h * ks1 + o[s] * ks2, ks2,
             vp + h * vs1 + o[s] * vs2, vs2, D, mask_rows, rows, n, (float)scale, pack,
             use_bf16, w, answer.where(w, i0, h), answer.stride());
      answer.done(w, i0, h, rows);
    }
  });
  return out;
}

at::Tensor encoder_attention(const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const std::optional<at::Tensor>& mask,
                             double scale) {
  return attention_into(query, key, value, mask, scale, nullptr);
}

at::Tensor packed_attention(const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& offsets, double scale) {
  return packed_attention_into(query, key, value, offsets, scale, nullptr);
}

// The quantization of the answer of `query` (its H * D features)
QuantizedAnswer quantized_answer(const at::Tensor& query, const std::optional<at::Tensor>& smooth,
                                 double scale, int64_t zero_point, int64_t quant_min,
                                 int64_t quant_max) {
  TORCH_CHECK(quant_min >= 0 && quant_max <= 255 && quant_min <= quant_max,
              "attention_quantized: a uint8 range only");
  QuantizedAnswer quant;
  if (smooth.has_value() && smooth->defined()) {
    quant.factors = smooth->contiguous().to(at::kFloat);
    TORCH_CHECK(quant.factors.numel() == query.size(1) * query.size(3),
                "attention_quantized: smooth must hold one factor a feature (heads x head_dim)");
    quant.smooth = quant.factors.data_ptr<float>();
  }
  quant.inv_scale = static_cast<float>(1.0 / scale);  // as quantize_per_tensor
  quant.zero_point = static_cast<float>(zero_point);
  quant.lo = static_cast<float>(quant_min);
  quant.hi = static_cast<float>(quant_max);
  return quant;
}

at::Tensor attention_quantized(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const std::optional<at::Tensor>& mask,
                               double scale, const std::optional<at::Tensor>& smooth,
                               double out_scale, int64_t zero_point, int64_t quant_min,
                               int64_t quant_max) {
  auto quant = quantized_answer(query, smooth, out_scale, zero_point, quant_min, quant_max);
  return attention_into(query, key, value, mask, scale, &quant);
}

at::Tensor packed_attention_quantized(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value, const at::Tensor& offsets,
                                      double scale, const std::optional<at::Tensor>& smooth,
                                      double out_scale, int64_t zero_point, int64_t quant_min,
                                      int64_t quant_max) {
  auto quant = quantized_answer(query, smooth, out_scale, zero_point, quant_min, quant_max);
  return packed_attention_into(query, key, value, offsets, scale, &quant);
}

// An encoder package allocates its activations afresh each forward (MBs at 8 x 128).
// glibc hands blocks above its mmap threshold to mmap, and trims the heap's top once
// twice that much lies free: sized by the largest block freed so far, which an int8
// encoder keeps small, so every forward faulted its pages in again (28% of the time on
// one Zen 5 core). Loading the kernel keeps blocks up to 32 MB (the most glibc takes) in
// the heap and up to 256 MB free at its top; COMPRESS_MALLOC_DEFAULTS=1 leaves glibc's.
struct KeepActivationPages {
  KeepActivationPages() {
#ifdef __GLIBC__
    if (std::getenv("COMPRESS_MALLOC_DEFAULTS") == nullptr) {
      mallopt(M_MMAP_THRESHOLD, 32 << 20);
      mallopt(M_TRIM_THRESHOLD, 256 << 20);
    }
#endif
  }
};
const KeepActivationPages keep_activation_pages;

}  // namespace

TORCH_LIBRARY(compress_encoder, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.def("packed_attention(Tensor query, Tensor key, Tensor value, Tensor offsets, float scale) "
        "-> Tensor");
  m.def("attention_quantized(Tensor query, Tensor key, Tensor value, Tensor? mask, "
        "float scale, Tensor? smooth, float out_scale, int zero_point, int quant_min, "
        "int quant_max) -> Tensor");
  m.def("packed_attention_quantized(Tensor query, Tensor key, Tensor value, Tensor offsets, "
        "float scale, Tensor? smooth, float out_scale, int zero_point, int quant_min, "
        "int quant_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_encoder, CPU, m) {
  m.impl("attention", &encoder_attention);
  m.impl("packed_attention", &packed_attention);
  m.impl("attention_quantized", &attention_quantized);
  m.impl("packed_attention_quantized", &packed_attention_quantized);
}
