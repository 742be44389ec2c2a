// compress_encoder::gelu_quantize: an int8 encoder's GELU, SmoothQuant's per-feature multiply
// and the per-tensor uint8 quantization of the next int8 linear's input, in one pass.
//
// With the multiply between GELU and the quantization, Inductor cannot fold the quantization
// into the oneDNN GEMM before it: GELU runs in the GEMM's epilogue (erf on every output,
// ~0.14 ms at 8 x 128 x 1536 on two Zen 5 cores) and a loop of its own then multiplies and
// quantizes the float answer. Here the GEMM writes its plain float answer and one loop
// computes GELU, multiplies and quantizes each element while it is in a register.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
// Phi(x) = 0.5 + 0.5 erf(x / sqrt 2), with erf(z) = z P(z^2) / Q(z^2) on [-4, 4] (erf(4) =
// 1 - 1.5e-8) and its error below 5e-6 (GELU's below 1e-5, a thousandth of a uint8 step of
// the activations it quantizes); the polynomials take x^2 and carry the 1 / sqrt 2 and 0.5
inline __m512 normal_cdf512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-5.656854249f)),
                    _mm512_set1_ps(5.656854249f));
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-1.1817039276632759e-07f);
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(5.124892819658904e-05f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(4.271508206992527e-03f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(2.854627759675242e-02f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(3.9895373663297073e-01f));
  __m512 q = _mm512_set1_ps(1.4472072581409247e-03f);
  q = _mm512_fmadd_ps(q, s, _mm512_set1_ps(2.5276514016962622e-02f));
  q = _mm512_fmadd_ps(q, s, _mm512_set1_ps(2.3834653410825285e-01f));
  q = _mm512_fmadd_ps(q, s, _mm512_set1_ps(1.f));
  __m512 r = _mm512_rcp14_ps(q);  // 1 / q: 14 bits, one Newton step to 24 (q >= 1)
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(q, r, _mm512_set1_ps(2.f)));
  return _mm512_fmadd_ps(_mm512_mul_ps(p, x), r, _mm512_set1_ps(0.5f));
}
#endif

// q[j] = clamp(rint(gelu(x[j]) * factor[j]) + zp), factor = smooth / scale
void gelu_row(const float* x, int64_t n, const float* factor, int32_t zero_point, int32_t lo,
              int32_t hi, uint8_t* q) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 zp = _mm512_set1_ps(static_cast<float>(zero_point));
  const __m512i lo_v = _mm512_set1_epi32(lo), hi_v = _mm512_set1_epi32(hi);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __m512 g = _mm512_mul_ps(v, normal_cdf512(v));  // GELU
    // rint(g * factor) + zp in one rounding (zp is whole; ties aside, the same), to even
    __m512i t = _mm512_cvtps_epi32(_mm512_fmadd_ps(g, _mm512_loadu_ps(factor + j), zp));
    t = _mm512_min_epi32(_mm512_max_epi32(t, lo_v), hi_v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(t));
  }
#endif
  for (; j < n; ++j) {
    const float g = 0.5f * x[j] * (1.f + std::erf(x[j] * 0.70710678118654752f));
    const float t = std::nearbyint(g * factor[j]) + zero_point;
    q[j] = static_cast<uint8_t>(std::fmin(std::fmax(t, lo), hi));
  }
}

at::Tensor gelu_quantize(const at::Tensor& input, const std::optional<at::Tensor>& smooth,
                         double scale, int64_t zero_point, int64_t quant_min,
                         int64_t quant_max) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "gelu_quantize: float32 only");
  TORCH_CHECK(quant_min >= 0 && quant_max <= 255 && quant_min <= quant_max,
              "gelu_quantize: a uint8 range only");
  const auto x = input.contiguous();
  const int64_t n = x.dim() ? x.size(-1) : 1, rows = n ? x.numel() / n : 0;
  // as quantized_decomposed.quantize_per_tensor: x * (1 / scale), the reciprocal in double
  const float inv_scale = static_cast<float>(1.0 / scale);
  const bool smoothed = smooth.has_value() && smooth->defined();
  TORCH_CHECK(!smoothed || smooth->numel() == n,
              "gelu_quantize: smooth must hold one factor a feature");
  const auto factor = smoothed ? smooth->contiguous().to(at::kFloat).reshape({n}) * inv_scale
                               : at::full({n}, inv_scale, x.options());
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* fp = factor.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      gelu_row(xp + i * n, n, fp, static_cast<int32_t>(zero_point),
               static_cast<int32_t>(quant_min), static_cast<int32_t>(quant_max), qp + i * n);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_encoder, m) {
  m.def("gelu_quantize(Tensor input, Tensor? smooth, float scale, int zero_point, "
        "int quant_min, int quant_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_encoder, CPU, m) {
  m.impl("gelu_quantize", &gelu_quantize);
}
