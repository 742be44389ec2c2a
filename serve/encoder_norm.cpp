// compress_encoder::add_layer_norm: an encoder's residual add, LayerNorm and the per-tensor
// uint8 quantization of the next int8 linear's input in one pass over each row.
//
// Inductor lowers `add -> layer_norm -> quantize` at a hidden size of 384 into three loops
// over the rows with a serial division between them (its two-step variance), ~0.1 ms at
// 8 x 128 on two Zen 5 cores; here each row is summed, centred and normalized while it
// stays in L1 (its float sum is written once, to `out`, and read back from there), or for a
// hidden size of 384 in registers (0.065 -> 0.054 ms a norm at 8 x 128, two Zen 5 cores).
//
// compress_encoder::embed_layer_norm: the same for an encoder's first norm, whose input is a
// sum of embedding rows (word, position, token type: rows of tables picked by integer ids).
// Inductor gathers them in a loop of its own that waits on each word row's cache miss (the
// table is 47 MB for MiniLM; ~0.19 ms at 8 x 128 on two Zen 5 cores); here the rows a few
// tokens ahead are prefetched while a token's rows are summed and normalized.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// out = the sum of rows[0, count); returns the sum of its elements
float sum_rows(const float* const* rows, int count, int64_t n, float* out) {
  int64_t j = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(rows[0] + j);
    for (int k = 1; k < count; ++k) v = _mm512_add_ps(v, _mm512_loadu_ps(rows[k] + j));
    _mm512_storeu_ps(out + j, v);
    acc = _mm512_add_ps(acc, v);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    out[j] = rows[0][j];
    for (int k = 1; k < count; ++k) out[j] += rows[k][j];
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

// The same for a row of kVecs * 16 features held in registers (MiniLM's 384: 24 of the 32),
// the sum of kCount input rows: each read once, out and q written once, where the loops above
// store the sum to `out` and read it back twice (perf: those reloads waited on the stores,
// ~30% of the norm)
template <int kVecs, int kCount>
void norm_row_in_registers(const float* const* rows, float eps, const float* weight,
                           const float* bias, const float* smooth, float inv_scale,
                           float zero_point, float lo, float hi, float* out, uint8_t* q) {
  constexpr int64_t n = 16 * kVecs;
  __m512 v[kVecs], part[4];
  for (auto& p : part) p = _mm512_setzero_ps();
#pragma GCC unroll 32
  for (int i = 0; i < kVecs; ++i) {
    v[i] = _mm512_loadu_ps(rows[0] + 16 * i);
    for (int k = 1; k < kCount; ++k) v[i] = _mm512_add_ps(v[i], _mm512_loadu_ps(rows[k] + 16 * i));
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

// The parameters every row of a norm shares.
struct NormParams {
  int64_t n;
  float eps;
  const float *weight, *bias, *smooth;  // smooth: SmoothQuant's multiply, or null
  float inv_scale, zero_point, lo, hi;
};

// out = LayerNorm(the sum of rows[0, count)), q its quantized copy
void norm_row(const float* const* rows, int count, const NormParams& p, float* out,
              uint8_t* q) {
#ifdef __AVX512F__
  if (p.n == 384 && count >= 1 && count <= 3) {
    auto run = count == 1 ? norm_row_in_registers<24, 1>
               : count == 2 ? norm_row_in_registers<24, 2> : norm_row_in_registers<24, 3>;
    run(rows, p.eps, p.weight, p.bias, p.smooth, p.inv_scale, p.zero_point, p.lo, p.hi, out,
        q);
    return;
  }
#endif
  const float mean = sum_rows(rows, count, p.n, out) / p.n;
  const float var = centred_squares(out, p.n, mean) / p.n;
  const float rstd = 1.f / std::sqrt(var + p.eps);
  normalize_row(out, p.n, mean, rstd, p.weight, p.bias, p.smooth, p.inv_scale, p.zero_point,
                p.lo, p.hi, q);
}

// The norm's parameters as float32 tensors, checked against its width `n`.
struct NormTensors {
  at::Tensor weight, bias, smooth;
  NormTensors(const char* op, int64_t n, const at::Tensor& w, const at::Tensor& b,
              const std::optional<at::Tensor>& by, int64_t quant_min, int64_t quant_max)
      : weight(w.contiguous().to(at::kFloat)), bias(b.contiguous().to(at::kFloat)) {
    TORCH_CHECK(quant_min >= 0 && quant_max <= 255 && quant_min <= quant_max, op,
                ": a uint8 range only");
    TORCH_CHECK(weight.numel() == n && bias.numel() == n, op,
                ": weight and bias of the last dim");
    if (by.has_value() && by->defined()) {
      smooth = by->contiguous().to(at::kFloat);
      TORCH_CHECK(smooth.numel() == n, op, ": smooth must hold one factor a feature");
    }
  }
  NormParams params(int64_t n, double eps, double scale, int64_t zero_point,
                    int64_t quant_min, int64_t quant_max) const {
    // as quantized_decomposed.quantize_per_tensor: x * (1 / scale), the reciprocal in double
    return {n, static_cast<float>(eps), weight.data_ptr<float>(), bias.data_ptr<float>(),
            smooth.defined() ? smooth.data_ptr<float>() : nullptr,
            static_cast<float>(1.0 / scale), static_cast<float>(zero_point),
            static_cast<float>(quant_min), static_cast<float>(quant_max)};
  }
};

std::tuple<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, const at::Tensor& bias, double eps,
    const std::optional<at::Tensor>& smooth, double scale, int64_t zero_point,
    int64_t quant_min, int64_t quant_max) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "add_layer_norm: float32 only");
  const auto x = input.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->sizes() == input.sizes() && residual->scalar_type() == at::kFloat,
                "add_layer_norm: the residual must match the input");
    res = residual->contiguous();
  }
  const NormTensors tensors("add_layer_norm", n, weight, bias, smooth, quant_min, quant_max);
  const NormParams p = tensors.params(n, eps, scale, zero_point, quant_min, quant_max);
  auto out = at::empty_like(x);
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* inputs[2] = {xp + i * n, rp ? rp + i * n : nullptr};
      norm_row(inputs, rp ? 2 : 1, p, op + i * n, qp + i * n);
    }
  });
  return {out, q};
}

constexpr int64_t kAhead = 4;  // tokens whose embedding rows are prefetched ahead

// LayerNorm(sum_k tables[k][ids[k]]) and its quantized copy; ids broadcast to one shape
std::tuple<at::Tensor, at::Tensor> embed_layer_norm(
    at::TensorList tables, at::TensorList ids, const at::Tensor& weight,
    const at::Tensor& bias, double eps, const std::optional<at::Tensor>& smooth,
    double scale, int64_t zero_point, int64_t quant_min, int64_t quant_max) {
  const int count = static_cast<int>(tables.size());
  TORCH_CHECK(count >= 1 && ids.size() == tables.size(),
              "embed_layer_norm: one ids tensor a table, at least one table");
  const int64_t n = tables[0].size(-1);
  std::vector<at::Tensor> table(count), index(count);
  at::DimVector sizes(ids[0].sizes().begin(), ids[0].sizes().end());  // ids broadcast
  for (int k = 1; k < count; ++k) sizes = at::infer_size_dimvector(sizes, ids[k].sizes());
  for (int k = 0; k < count; ++k) {
    TORCH_CHECK(tables[k].dim() == 2 && tables[k].size(1) == n &&
                    tables[k].scalar_type() == at::kFloat,
                "embed_layer_norm: float32 tables of one width");
    TORCH_CHECK(!at::isFloatingType(ids[k].scalar_type()), "embed_layer_norm: integer ids");
    table[k] = tables[k].contiguous();
    index[k] = ids[k].to(at::kLong).expand(sizes).contiguous();
  }
  const NormTensors tensors("embed_layer_norm", n, weight, bias, smooth, quant_min, quant_max);
  const NormParams p = tensors.params(n, eps, scale, zero_point, quant_min, quant_max);
  at::DimVector out_sizes(sizes.begin(), sizes.end());
  out_sizes.push_back(n);
  auto out = at::empty(out_sizes, table[0].options());
  auto q = at::empty(out_sizes, table[0].options().dtype(at::kByte));
  const int64_t tokens = index[0].numel();
  std::vector<const float*> tp(count);
  std::vector<const int64_t*> ip(count);
  std::vector<int64_t> limit(count);
  for (int k = 0; k < count; ++k) {
    tp[k] = table[k].data_ptr<float>();
    ip[k] = index[k].data_ptr<int64_t>();
    limit[k] = table[k].size(0);
  }
  float* op = out.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<const float*> rows(count);
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end)  // the word row of a token ahead misses the caches
        for (int k = 0; k < count; ++k) {
          const int64_t id = ip[k][i + kAhead];
          if (id < 0 || id >= limit[k]) continue;  // checked when its turn comes
          const char* row = reinterpret_cast<const char*>(tp[k] + id * n);
          for (int64_t byte = 0; byte < n * 4; byte += 64)
            __builtin_prefetch(row + byte, 0, 3);
        }
      for (int k = 0; k < count; ++k) {
        const int64_t id = ip[k][i];
        TORCH_CHECK(id >= 0 && id < limit[k], "embed_layer_norm: id ", id,
                    " out of range for a table of ", limit[k], " rows");
        rows[k] = tp[k] + id * n;
      }
      norm_row(rows.data(), count, p, op + i * n, qp + i * n);
    }
  });
  return {out, q};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compress_encoder, m) {
  m.def("add_layer_norm(Tensor input, Tensor? residual, Tensor weight, Tensor bias, "
        "float eps, Tensor? smooth, float scale, int zero_point, int quant_min, "
        "int quant_max) -> (Tensor, Tensor)");
  m.def("embed_layer_norm(Tensor[] tables, Tensor[] ids, Tensor weight, Tensor bias, "
        "float eps, Tensor? smooth, float scale, int zero_point, int quant_min, "
        "int quant_max) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(compress_encoder, CPU, m) {
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("embed_layer_norm", &embed_layer_norm);
}
