// compress_encoder::add_layer_norm: an encoder's residual add, LayerNorm and the per-tensor
// uint8 quantization of the next int8 linear's input in one pass over each row.
//
// Inductor lowers `add -> layer_norm -> quantize` at a hidden size of 384 into three loops
// over the rows with a serial division between them (its two-step variance), ~0.1 ms at
// 8 x 128 on two Zen 5 cores; here each row is summed, centred and normalized while it
// stays in L1 (its float sum is written once, to `out`, and read back from there), or for a
// hidden size of 384 in registers (0.065 -> 0.054 ms a norm at 8 x 128, two Zen 5 cores).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// out = x + residual (residual may be null); returns the row's sum
float add_row(const float* x, const float* residual, int64_t n, float* out) {
  int64_t j = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(x + j);
    if (residual) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + j));
    _mm512_storeu_ps(out + j, v);
    acc = _mm512_add_ps(acc, v);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    out[j] = x[j] + (residual ? residual[j] : 0.f);
    total += out[j];
  }
  return total;
}

float centred_squares(const float* row, int64_t n, float mean) {
  int64_t j = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mean);
  for (; j + 16 <= n; j += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(row + j), m);
    acc = _mm512_fmadd_ps(d, d, acc);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) total += (row[j] - mean) * (row[j] - mean);
  return total;
}

#ifdef __AVX512F__
// q[0, 16) = clamp(rint(y * smooth / scale) + zp), smooth a per-feature multiply
// (SmoothQuant's, null: none)
struct Quantizer {
  __m512 inv, zp, lo, hi;
  Quantizer(float inv_scale, float zero_point, float low, float high)
      : inv(_mm512_set1_ps(inv_scale)), zp(_mm512_set1_ps(zero_point)),
        lo(_mm512_set1_ps(low)), hi(_mm512_set1_ps(high)) {}
  void store(__m512 y, const float* smooth, uint8_t* q) const {
    if (smooth) y = _mm512_mul_ps(y, _mm512_loadu_ps(smooth));
    __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(y, inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(t, zp), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));
  }
};
#endif

// row = (row - mean) * rstd * weight + bias in place; q = clamp(rint(row * smooth / scale)
// + zp), smooth a per-feature multiply (SmoothQuant's, null: none)
void normalize_row(float* row, int64_t n, float mean, float rstd, const float* weight,
                   const float* bias, const float* smooth, float inv_scale, float zero_point,
                   float lo, float hi, uint8_t* q) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 m = _mm512_set1_ps(mean), r = _mm512_set1_ps(rstd);
  const Quantizer quantize(inv_scale, zero_point, lo, hi);
  for (; j + 16 <= n; j += 16) {
    __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), m), r);
    y = _mm512_fmadd_ps(y, _mm512_loadu_ps(weight + j), _mm512_loadu_ps(bias + j));
    _mm512_storeu_ps(row + j, y);
    quantize.store(y, smooth ? smooth + j : nullptr, q + j);
  }
#endif
  for (; j < n; ++j) {
    const float y = (row[j] - mean) * rstd * weight[j] + bias[j];
    row[j] = y;
    const float t = std::nearbyint((smooth ? y * smooth[j] : y) * inv_scale) + zero_point;
    q[j] = static_cast<uint8_t>(std::fmin(std::fmax(t, lo), hi));
  }
}

#ifdef __AVX512F__
// the sum of four partial sums' lanes
inline float sum4(const __m512* part) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(part[0], part[1]),
                                            _mm512_add_ps(part[2], part[3])));
}

// The same for a row of kVecs * 16 features held in registers (MiniLM's 384: 24 of the 32):
// x and residual read once, out and q written once, where the loops above store the sum to
// `out` and read it back twice (perf: those reloads waited on the stores, ~30% of the norm)
template <int kVecs>
void norm_row_in_registers(const float* x, const float* residual, float eps,
                           const float* weight, const float* bias, const float* smooth,
                           float inv_scale, float zero_point, float lo, float hi, float* out,
                           uint8_t* q) {
  constexpr int64_t n = 16 * kVecs;
  __m512 v[kVecs], part[4];
  for (auto& p : part) p = _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int i = 0; i < kVecs; ++i) {
    v[i] = _mm512_loadu_ps(x + 16 * i);
    if (residual) v[i] = _mm512_add_ps(v[i], _mm512_loadu_ps(residual + 16 * i));
    part[i & 3] = _mm512_add_ps(part[i & 3], v[i]);
  }
  const float mean = sum4(part) / n;
  const __m512 m = _mm512_set1_ps(mean);
  for (auto& p : part) p = _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int i = 0; i < kVecs; ++i) {
    v[i] = _mm512_sub_ps(v[i], m);
    part[i & 3] = _mm512_fmadd_ps(v[i], v[i], part[i & 3]);
  }
  const float var = sum4(part) / n;
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(var + eps));
  const Quantizer quantize(inv_scale, zero_point, lo, hi);
#pragma GCC unroll 32
  for (int i = 0; i < kVecs; ++i) {
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(v[i], r), _mm512_loadu_ps(weight + 16 * i),
                                     _mm512_loadu_ps(bias + 16 * i));
    _mm512_storeu_ps(out + 16 * i, y);
    quantize.store(y, smooth ? smooth + 16 * i : nullptr, q + 16 * i);
  }
}
#endif

std::tuple<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, const at::Tensor& bias, double eps,
    const std::optional<at::Tensor>& smooth, double scale, int64_t zero_point,
    int64_t quant_min, int64_t quant_max) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "add_layer_norm: float32 only");
  TORCH_CHECK(quant_min >= 0 && quant_max <= 255 && quant_min <= quant_max,
              "add_layer_norm: a uint8 range only");
  const auto x = input.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->sizes() == input.sizes() && residual->scalar_type() == at::kFloat,
                "add_layer_norm: the residual must match the input");
    res = residual->contiguous();
  }
  const auto w = weight.contiguous().to(at::kFloat), b = bias.contiguous().to(at::kFloat);
  TORCH_CHECK(w.numel() == n && b.numel() == n, "add_layer_norm: weight and bias of the last dim");
  at::Tensor by;
  if (smooth.has_value() && smooth->defined()) {
    by = smooth->contiguous().to(at::kFloat);
    TORCH_CHECK(by.numel() == n, "add_layer_norm: smooth must hold one factor a feature");
  }
  auto out = at::empty_like(x);
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* sp = by.defined() ? by.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  // as quantized_decomposed.quantize_per_tensor: x * (1 / scale), the reciprocal in double
  const float inv_scale = static_cast<float>(1.0 / scale);
  const float zp = static_cast<float>(zero_point), lo = quant_min, hi = quant_max;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = op + i * n;
#ifdef __AVX512F__
      if (n == 384) {
        norm_row_in_registers<24>(xp + i * n, rp ? rp + i * n : nullptr,
                                  static_cast<float>(eps), wp, bp, sp, inv_scale, zp, lo, hi,
                                  row, qp + i * n);
        continue;
      }
#endif
      const float mean = add_row(xp + i * n, rp ? rp + i * n : nullptr, n, row) / n;
      const float var = centred_squares(row, n, mean) / n;
      const float rstd = 1.f / std::sqrt(var + static_cast<float>(eps));
      normalize_row(row, n, mean, rstd, wp, bp, sp, inv_scale, zp, lo, hi, qp + i * n);
    }
  });
  return {out, q};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_encoder, m) {
  m.def("add_layer_norm(Tensor input, Tensor? residual, Tensor weight, Tensor bias, "
        "float eps, Tensor? smooth, float scale, int zero_point, int quant_min, "
        "int quant_max) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(compress_encoder, CPU, m) {
  m.impl("add_layer_norm", &add_layer_norm);
}
