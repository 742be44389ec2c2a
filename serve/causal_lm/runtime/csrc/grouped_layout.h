// The record layout the grouped kernels share (grouped_kernels.cpp lays weights out and
// multiplies float32 activations; grouped_int8_activations.cpp multiplies int8 ones,
// grouped_bf16_activations.cpp bfloat16 ones).
//
// Output features come in tiles of 16; per tile and group of 32 inputs, one record: the
// codes input by input (16 outputs' codes of input i side by side; at 4 bits inputs 2p and
// 2p + 1 share a byte, low and high nibble), then the 16 scales and 16 offsets, float16 or
// float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace compress_lm {

constexpr int64_t GROUP = 32;
constexpr int64_t QUADS = GROUP / 4;  // quads of inputs a group (int8 activations, 2:4 weights)
constexpr int64_t TILE = 16;  // output features per record
constexpr int64_t ROWS = 8;   // activation rows per pass over a tile
// activation rows per pass of the AVX-512 float32 kernels (grouped_mm, sparse24_mm) and the
// bfloat16 one: each row summed in 4 partial sums a group whatever the row count (so every
// row is summed as a lone row is: batch invariance), and 4 rows x 4 sums + 4 accumulators
// are 20 of the 32 zmm
constexpr int64_t INVARIANT_ROWS = 4;
// activation rows per pass of this build's float32 kernels (grouped_mm's AVX-512 and
// portable paths, sparse24_mm): 4 on AVX-512 (INVARIANT_ROWS), else ROWS (one sum a row)
#if defined(__AVX512F__)
constexpr int64_t FLOAT_PASS_ROWS = INVARIANT_ROWS;
#else
constexpr int64_t FLOAT_PASS_ROWS = ROWS;
#endif

constexpr int64_t code_bytes(int64_t bits) { return TILE * GROUP * bits / 8; }
constexpr int64_t record_bytes(int64_t bits, bool half) {
  return code_bytes(bits) + 2 * TILE * (half ? 2 : 4);
}

// the checks both products make on their operands; the activations as rows x k
inline at::Tensor product_rows(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                               int64_t bits, bool half, const char* name) {
  TORCH_CHECK(bits == 8 || bits == 4, name, ": bits must be 8 or 4, not ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": activations must be float32");
  const int64_t k = x.size(-1), groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(k % GROUP == 0 && packed.numel() == tiles * groups * record_bytes(bits, half),
              name, ": ", packed.numel(), " packed bytes do not hold ", n, " x ", k, " at ",
              bits, " bits");
  return x.reshape({-1, k}).contiguous();
}

// a record's 16 scales, then its 16 offsets, as float32
template <int BITS, bool HALF>
inline void record_scales(const uint8_t* rec, float* out) {
  if constexpr (!HALF) {
    std::memcpy(out, rec + code_bytes(BITS), 2 * TILE * sizeof(float));
  } else {
    const at::Half* half = reinterpret_cast<const at::Half*>(rec + code_bytes(BITS));
    for (int j = 0; j < 2 * TILE; ++j) out[j] = static_cast<float>(half[j]);
  }
}

#if defined(__AVX512F__)
// the same, one vector each
template <int BITS, bool HALF>
inline void record_scales(const uint8_t* rec, __m512& scale, __m512& offset) {
  if constexpr (!HALF) {
    const float* values = reinterpret_cast<const float*>(rec + code_bytes(BITS));
    scale = _mm512_loadu_ps(values);
    offset = _mm512_loadu_ps(values + TILE);
  } else {
    const __m256i* half = reinterpret_cast<const __m256i*>(rec + code_bytes(BITS));
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(half));
    offset = _mm512_cvtph_ps(_mm256_loadu_si256(half + 1));
  }
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// the same, two ymm each (outputs 0-7, 8-15): the AVX2 paths'
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
#endif

// f(std::integral_constant<int, BITS>{}, std::bool_constant<HALF>{}): a kernel specialized
// for a weight's record layout (8 or 4 bits, float16 or float32 scales)
template <typename F>
inline void with_layout(int64_t bits, bool half, F&& f) {
  if (bits == 8 && half)
    f(std::integral_constant<int, 8>{}, std::true_type{});
  else if (bits == 8)
    f(std::integral_constant<int, 8>{}, std::false_type{});
  else if (half)
    f(std::integral_constant<int, 4>{}, std::true_type{});
  else
    f(std::integral_constant<int, 4>{}, std::false_type{});
}

#if defined(__AVX512F__)
// a group's P partial sums of R rows into their accumulators: the codes' sum scaled once,
// plus the record's offsets times the row's sum of x over the group (`xsum`: row-major,
// `groups` a row)
template <int BITS, bool HALF, int P, int R>
inline void add_group(const uint8_t* rec, __m512 (&part)[P][R], const float* xsum,
                      int64_t groups, int64_t g, __m512 (&acc)[R]) {
  __m512 s, o;
  record_scales<BITS, HALF>(rec, s, o);
  for (int r = 0; r < R; ++r) {
    __m512 sum = part[0][r];
    for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, part[p][r]);
    acc[r] = _mm512_fmadd_ps(sum, s, acc[r]);
    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), o, acc[r]);
  }
}

// R rows' accumulators stored as the tile's `valid` outputs of each output row
template <int R>
inline void store_rows(const __m512 (&acc)[R], float* out, int64_t n_out, int64_t valid) {
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * n_out, keep, acc[r]);
}
#endif

// f(std::integral_constant<int, R>{}) for R = r, 1..ROWS: a kernel specialized per row count
template <typename F>
inline void with_rows(int64_t r, F&& f) {
  switch (r) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// x (..., k) times the packed weight with float32 activations (grouped_kernels.cpp)
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                      bool half);

}  // namespace compress_lm
