// 2:4 sparse int8 / 4-bit weights times float32 activations, reading each weight group once
// for every row of the batch: the sparse twin of grouped_kernels.cpp (built with it by
// grouped_kernels.py; no Python inside).
//
// A 2:4 weight has at most 2 non-zeros in every 4 consecutive inputs (a "quad"). Per output
// and quad it keeps 2 values (their codes) and their 2 positions in the quad (2 bits each,
// ascending); per output and group of 32 inputs one scale (symmetric grid, no offset, so a
// pruned weight is exactly 0):
//
//   out[m, n] = sum_g scale[n, g] * sum_{q in g} sum_{s in 0, 1} code[n, q, s] * x[m, 4q + pos[n, q, s]]
//
// which is x @ (masked dequantized weight)^T to float32 rounding.
//
// Records (sparse24.py's `pack_records` lays them out): output features in tiles of 16, and
// per tile and group of 32 inputs one record:
//   codes      8 bits: 16 slots (quad q's kept values are slots 2q, 2q + 1), each slot the
//              16 outputs' int8 codes side by side (256 bytes); 4 bits: per quad the 16
//              outputs' bytes, slot 2q in the low nibble and 2q + 1 in the high one, signed
//              (128 bytes);
//   positions  per pair of quads (2p, 2p + 1) the 16 outputs' bytes: quad 2p's positions in
//              the low nibble (first in bits 0-1, second in bits 2-3), quad 2p + 1's in the
//              high nibble (64 bytes);
//   scales     the 16 outputs' float16 scales (32 bytes).
// That is 352 bytes per 512 weights at 8 bits (0.69 a weight) and 224 at 4 bits (0.44).
//
// The product is grouped_mm's outer-product form: per kept slot, the 16 codes are widened to
// float32 once (8 bits: a sign extension and a conversion; 4 bits: a permute from a table of
// the 16 nibble values, cheaper than the shifts and conversion it replaced: 1536 x 576 at
// one row, weights in cache, 1.0x the dense 4-bit time before, 0.78x after); each activation
// row's 4 inputs of a quad are broadcast to every 128 bits of one vector, from which an
// in-lane permute picks, for every output lane, the input its slot keeps; a multiply-add
// per slot and row, one scale per group. AVX-512: 4 partial sums over alternating slots at
// every row count, 4 rows a pass (each row summed as a lone row is: batch invariance).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "grouped_layout.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace compress_lm {
namespace {

// QUADS (grouped_layout.h): quads per group, 8, two kept slots each

constexpr int64_t sparse_code_bytes(int64_t bits) { return TILE * 2 * QUADS * bits / 8; }
constexpr int64_t sparse_position_bytes() { return TILE * QUADS / 2; }
constexpr int64_t sparse_record_bytes(int64_t bits) {
  return sparse_code_bytes(bits) + sparse_position_bytes() + TILE * 2;
}

#if defined(__AVX512F__)

// one quad's two slots (codes w0, w1; positions in `pos`'s bits 0-1 and 2-3) against the
// R rows' 4 inputs of the quad at `xq` (a row every k floats). The quad's inputs repeat in
// every 128 bits of the vector, so a permute index's bits above the low 2 pick the same
// input: the positions need no masking.
template <int P, int R>
inline void add_quad(__m512i pos, __m512 w0, __m512 w1, int slot, const float* xq, int64_t k,
                     __m512 (&part)[P][R]) {
  const __m512i second = _mm512_srli_epi32(pos, 2);
  for (int r = 0; r < R; ++r) {
    const __m512 x4 = _mm512_broadcast_f32x4(_mm_loadu_ps(xq + r * k));
    part[slot % P][r] = _mm512_fmadd_ps(w0, _mm512_permutevar_ps(x4, pos), part[slot % P][r]);
    part[(slot + 1) % P][r] =
        _mm512_fmadd_ps(w1, _mm512_permutevar_ps(x4, second), part[(slot + 1) % P][r]);
  }
}

// quad q's two slots' codes, as float32 vectors
template <int BITS>
inline void quad_codes(const uint8_t* rec, int q, __m512& w0, __m512& w1) {
  const __m128i* codes = reinterpret_cast<const __m128i*>(rec);
  if constexpr (BITS == 8) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 2 * q)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(codes + 2 * q + 1)));
  } else {  // signed nibbles looked up in a table of their 16 values (a permute reads an
            // index's low 4 bits: the low nibble needs no mask, the high one a shift)
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes + q));
    w0 = _mm512_permutexvar_ps(both, values);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(both, 4), values);
  }
}

// R activation rows against one tile: out[r, 0..15] for this tile
template <int BITS, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = sparse_record_bytes(BITS);
  constexpr int P = 4;  // at every row count, as grouped_kernels.cpp's tile_rows
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T0);
    __m512 part[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) part[p][r] = _mm512_setzero_ps();
    const __m128i* positions =
        reinterpret_cast<const __m128i*>(rec + sparse_code_bytes(BITS));
    const float* xg = x + g * GROUP;
#pragma GCC unroll 4
    for (int pair = 0; pair < QUADS / 2; ++pair) {  // quads 2 * pair and 2 * pair + 1
      const __m512i pos = _mm512_cvtepu8_epi32(_mm_loadu_si128(positions + pair));
      const int q = 2 * pair;
      __m512 w0, w1;
      quad_codes<BITS>(rec, q, w0, w1);
      add_quad<P, R>(pos, w0, w1, 2 * q, xg + 4 * q, k, part);
      quad_codes<BITS>(rec, q + 1, w0, w1);
      add_quad<P, R>(_mm512_srli_epi32(pos, 4), w0, w1, 2 * q + 2, xg + 4 * q + 4, k, part);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        rec + sparse_code_bytes(BITS) + sparse_position_bytes())));
    for (int r = 0; r < R; ++r) {
      __m512 sum = part[0][r];
      for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, part[p][r]);
      acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
    }
  }
  store_rows(acc, out, n_out, valid);
}

#else  // portable: the same arithmetic, left to the compiler

template <int BITS, int R>
inline void tile_rows(const uint8_t* rec, int64_t groups, const float* x, int64_t k,
                      float* out, int64_t n_out, int64_t valid) {
  constexpr int64_t RB = sparse_record_bytes(BITS);
  float acc[R][TILE] = {};
  for (int64_t g = 0; g < groups; ++g, rec += RB) {
    float part[R][TILE] = {};
    const uint8_t* positions = rec + sparse_code_bytes(BITS);
    const float* xg = x + g * GROUP;
    for (int q = 0; q < QUADS; ++q)
      for (int j = 0; j < TILE; ++j) {
        const uint8_t both = positions[(q / 2) * TILE + j];
        const int nibble = q % 2 ? both >> 4 : both & 15;
        float w0, w1;
        if constexpr (BITS == 8) {
          w0 = static_cast<int8_t>(rec[(2 * q) * TILE + j]);
          w1 = static_cast<int8_t>(rec[(2 * q + 1) * TILE + j]);
        } else {
          const uint8_t codes = rec[q * TILE + j];
          w0 = static_cast<int8_t>(codes << 4) >> 4;
          w1 = static_cast<int8_t>(codes) >> 4;
        }
        for (int r = 0; r < R; ++r)
          part[r][j] += w0 * xg[r * k + 4 * q + (nibble & 3)] +
                        w1 * xg[r * k + 4 * q + (nibble >> 2)];
      }
    const at::Half* scale =
        reinterpret_cast<const at::Half*>(positions + sparse_position_bytes());
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < TILE; ++j) acc[r][j] += part[r][j] * static_cast<float>(scale[j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < valid; ++j) out[r * n_out + j] = acc[r][j];
}

#endif

template <int BITS>
void tiles_pass(const float* x, int64_t rows, int64_t k, int64_t n, const uint8_t* packed,
                float* out, int64_t begin, int64_t end) {
  const int64_t groups = k / GROUP, tile_bytes = groups * sparse_record_bytes(BITS);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * TILE, valid = std::min(TILE, n - n0);
    for (int64_t m = 0; m < rows; m += FLOAT_PASS_ROWS)
      with_rows(std::min(FLOAT_PASS_ROWS, rows - m), [&](auto r) {
        tile_rows<BITS, decltype(r)::value>(packed + t * tile_bytes, groups, x + m * k, k,
                                            out + m * n + n0, n, valid);
      });
  }
}

}  // namespace

// x (..., k) float32 times the 2:4 records of an n x k weight: (..., n) float32
at::Tensor sparse24_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "sparse24_mm: bits must be 8 or 4, not ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "sparse24_mm: activations must be float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "sparse24_mm: the records must be contiguous bytes");
  const int64_t k = x.size(-1), groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(k % GROUP == 0 && packed.numel() == tiles * groups * sparse_record_bytes(bits),
              "sparse24_mm: ", packed.numel(), " packed bytes do not hold ", n, " x ", k,
              " at ", bits, " bits");
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x2.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    if (bits == 8)
      tiles_pass<8>(xp, rows, k, n, pp, yp, begin, end);
    else
      tiles_pass<4>(xp, rows, k, n, pp, yp, begin, end);
  });
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  return out.view(out_shape);
}

}  // namespace compress_lm

TORCH_LIBRARY_FRAGMENT(compress_lm, m) {
  m.def("sparse24_mm(Tensor x, Tensor packed, int n, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("sparse24_mm", &compress_lm::sparse24_mm);
}
