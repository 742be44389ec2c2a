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
// dequantization per weight and no horizontal sum. Up to 5 rows, 4 partial sums over
// alternating inputs keep the multiply-adds of one chain from waiting on each other (and
// give every row the arithmetic of a one-row product, bit for bit). More
// than 8 rows (a prefill) go in chunks of 8 while a tile's records stay in cache.
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "grouped_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace compress_lm {
namespace {

#if defined(__AVX512F__)

// R activation rows against one tile: out[r, 0..15] for this tile
template <int BITS, bool HALF, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      const float* xsum, float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = record_bytes(BITS, HALF);
  // partial sums per row: 4 (the multiply-adds of one chain need not wait on each other)
  // up to 5 rows, so that a row's sums are those of a one-row step, bit for bit (a
  // speculative verification of 2-5 positions gives a decode step's logits); then 1
  constexpr int P = R <= 5 ? 4 : 1;
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

template <int BITS, bool HALF>
void tiles_pass(const float* x, const float* xsum, int64_t rows, int64_t k, int64_t n,
                const uint8_t* packed, float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP;
  const int64_t tile_bytes = groups * record_bytes(BITS, HALF);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    for (int64_t m = 0; m < rows; m += ROWS)
      with_rows(std::min(ROWS, rows - m), [&](auto r) {
        tile_rows<BITS, HALF, decltype(r)::value>(packed + t * tile_bytes, groups, x + m * k,
                                                  k, xsum + m * groups, out + m * n + n0, n,
                                                  valid);
      });
  }
}

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
  // grouped_int8_activations.cpp
  m.def("grouped_mm_int8(Tensor x, Tensor packed, int n, int bits, bool half) -> Tensor");
  // grouped_bf16_activations.cpp
  m.def("grouped_mm_bf16(Tensor x, Tensor packed, int n, int bits, bool half) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("grouped_pack", &compress_lm::grouped_pack);
  m.impl("grouped_mm", &compress_lm::grouped_mm);
}
