// Attention of new queries over a KV cache whose every answer depends on its own row only:
// a row's outputs are the same bits alone and beside any other rows, whatever the padding
// before its first position, the cache length read, or how its prompt was cut into prefill
// chunks (batch invariance; attention.py's `invariant_attention` calls it for models whose
// products run on this library's kernels, which are batch-invariant too).
//
// For row b, query head h (key-value head h / (H / KVH)) and query position t, over the
// positions j the row may attend (`valid[b, t, j]`; without a mask, j <= L - T + t):
//
//   s_j = scale * q . k_j,   p_j = exp(s_j - max s),   out = sum_j p_j v_j / sum_j p_j
//
// Each sum runs over the attended positions in ascending order, counted from the first:
// the dot product in 8 partial sums over the head dimension, added in a fixed tree (on AVX2,
// four keys' at a time: four chains in flight; whether a position goes in a four or alone
// depends on its rank among the row's own positions only); the exponentials' sum one after
// another; the values' weighted sum position after position, each output dimension on its
// own. So the positions a row may not attend (another row's
// padding, a longer window) change no rounding, where a vectorized softmax over the whole
// window (torch's, Inductor's) groups its terms by where they lie. float32 throughout, as
// the decode attention in torch operations was; it differs from it by reduction order only.
// Cost: a loop per query, where SDPA's flash attention blocks its products: on a Zen 1 a
// 1,000-token prompt prefills 11% later (7064 against 6351 ms), decode steps are as fast or
// faster (benchmarks/results/llm_attention.md).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace compress_lm {
namespace {

constexpr int64_t LANES = 8;  // partial sums of a dot product

// q . k over `dim` values, in LANES partial sums (value d into sum d % LANES) added in a
// fixed tree: the same bits wherever k lies
inline float dot(const float* q, const float* k, int64_t dim) {
  float part[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= dim; d += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += q[d + l] * k[d + l];
  for (int64_t l = 0; d < dim; ++d, ++l) part[l] += q[d] * k[d];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
// dot() of four keys at once, with intrinsics: lane l of each accumulator is dot()'s
// part[l] (the same fused multiply-adds in the same order), added in dot()'s tree
inline void dot4(const float* q, const float* const* k, int64_t dim, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t d = 0; d < dim; d += LANES) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[c] + d), acc[c]);
  }
  for (int c = 0; c < 4; ++c) {
    alignas(32) float t[LANES];
    _mm256_store_ps(t, acc[c]);
    out[c] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
}
#endif

}  // namespace

// query (B, H, T, D), key and value (B, KVH, L, D), each with D contiguous; valid: bool
// (B, T, L), or none (causal, the queries the last T positions); out (B, T, H, D)
at::Tensor cache_attention(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& valid,
                           double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "cache_attention: query, key and value must be 4-D (rows, heads, length, dim)");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "cache_attention: query, key and value must be float32");
  const int64_t rows = query.size(0), heads = query.size(1), length = query.size(2),
                dim = query.size(3), kv_heads = key.size(1), cached = key.size(2);
  TORCH_CHECK(key.size(0) == rows && value.sizes() == key.sizes() && key.size(3) == dim &&
                  kv_heads > 0 && heads % kv_heads == 0,
              "cache_attention: key ", key.sizes(), " and value ", value.sizes(),
              " do not fit query ", query.sizes());
  const at::Tensor q = query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  at::Tensor mask;
  if (valid.has_value()) {
    mask = valid->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 3 && mask.size(0) == rows && mask.size(1) == length &&
                    mask.size(2) == cached,
                "cache_attention: valid ", mask.sizes(), " must be (rows, queries, cached) = (",
                rows, ", ", length, ", ", cached, ")");
  }
  at::Tensor out = at::empty({rows, length, heads, dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kl = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vl = v.stride(2);
  const int64_t group = heads / kv_heads;
  const float s = static_cast<float>(scale);
  // one unit: a row, a query head, a query position
  at::parallel_for(0, rows * heads * length, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(cached);
    std::vector<int64_t> position(cached);
    std::vector<float> sum(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t t = unit % length, h = (unit / length) % heads, b = unit / (length * heads);
      const float* qv = qp + ((b * heads + h) * length + t) * dim;
      const float* keys = kp + b * kb + (h / group) * kh;
      const float* values = vp + b * vb + (h / group) * vh;
      float* o = op + ((b * length + t) * heads + h) * dim;
      int64_t n = 0;
      const bool* allowed = mp ? mp + (b * length + t) * cached : nullptr;
      const int64_t last = mp ? cached : cached - length + t + 1;  // causal, without a mask
      for (int64_t j = 0; j < last; ++j)
        if (!allowed || allowed[j]) position[n++] = j;
      if (n == 0) {  // nothing to attend (an empty slot of a batch): zeros, not NaN
        std::fill_n(o, dim, 0.f);
        continue;
      }
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if (dim % LANES == 0)  // four keys at a time (four chains in flight), by rank
        for (; i + 4 <= n; i += 4) {
          const float* four[4] = {keys + position[i] * kl, keys + position[i + 1] * kl,
                                  keys + position[i + 2] * kl, keys + position[i + 3] * kl};
          dot4(qv, four, dim, &score[i]);
        }
#endif
      for (; i < n; ++i) score[i] = dot(qv, keys + position[i] * kl, dim);
      float top = -std::numeric_limits<float>::infinity();
      for (i = 0; i < n; ++i) {
        score[i] *= s;
        top = std::max(top, score[i]);
      }
      float total = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        score[i] = std::exp(score[i] - top);
        total += score[i];
      }
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float p = score[i];
        const float* row = values + position[i] * vl;
        for (int64_t d = 0; d < dim; ++d) sum[d] += p * row[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] = sum[d] / total;
    }
  });
  return out;
}

}  // namespace compress_lm

TORCH_LIBRARY_FRAGMENT(compress_lm, m) {
  m.def("cache_attention(Tensor query, Tensor key, Tensor value, Tensor? valid, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("cache_attention", &compress_lm::cache_attention);
}
