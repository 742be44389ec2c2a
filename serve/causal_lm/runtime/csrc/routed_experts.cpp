// A mixture-of-experts layer's routed experts in one operator (experts.py's GroupedExperts
// calls it; built with grouped_kernels.cpp by grouped_kernels.py; no Python inside):
//
//   out[t] = sum over t's top-k slots s of weight[t, s] * down_e(act(gate_e(x[t])) * up_e(x[t]))
//
// with e = index[t, s], each projection one grouped_mm (or its int8 / bf16 activation twin)
// on expert e's packed records, so a token reads its experts' groups and no others. Experts
// are visited in ascending order, each with the (token, slot) pairs routed to it in token
// order, their weighted rows added to `out` in that order: experts.py's `routed_experts`
// to float32 rounding (the activation is std::exp / std::erf's, not ATen's vectorized one).
// An index outside 0..E-1 (an expert another expert-parallel rank holds) is skipped.
// Written in C++ with plain loops because that loop in Python cost a decode step ~20 ATen
// calls and a host sync per layer (unique, tolist, where, index_add_, ...): at one token
// and SmolLM2's MoE shapes (8 experts of 576 -> 192), 145 us a layer in Python, 70 us with
// the same ATen calls from C++, 39 us with loops.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "grouped_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace compress_lm {
namespace {

using ProductSignature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool);
using ProductHandle = c10::TypedOperatorHandle<ProductSignature>;

// an operator of the library, looked up once
ProductHandle registered(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<ProductSignature>();
}

// the product of an activation mode: 0 float32 (grouped_mm, called directly), 1 int8 and
// 2 bf16 (their operators, through the dispatcher), as experts.py's MODE_CODES number them
at::Tensor product(int64_t activations, const at::Tensor& x, const at::Tensor& packed,
                   int64_t n, int64_t bits, bool half) {
  static const ProductHandle int8 = registered("compress_lm::grouped_mm_int8");
  static const ProductHandle bf16 = registered("compress_lm::grouped_mm_bf16");
  switch (activations) {
    case 0: return grouped_mm(x, packed, n, bits, half);
    case 1: return int8.call(x, packed, n, bits, half);
    case 2: return bf16.call(x, packed, n, bits, half);
    default: TORCH_CHECK(false, "routed_experts: activations must be 0 (float32), 1 (int8) or "
                         "2 (bf16), not ", activations);
  }
}

// the experts' hidden activation: 0 silu, 1 gelu (exact), 2 relu (experts.py's ACT_CODES)
inline float activate(float g, int64_t act) {
  switch (act) {
    case 0: return g / (1.f + std::exp(-g));
    case 1: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    default: return g > 0.f ? g : 0.f;
  }
}

}  // namespace

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                          const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                          const at::Tensor& down, int64_t intermediate, int64_t bits,
                          bool half_gate_up, bool half_down, int64_t act,
                          int64_t activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "routed_experts: x must be (tokens, hidden) float32");
  TORCH_CHECK(top_k_index.dim() == 2 && top_k_index.size(0) == x.size(0) &&
                  top_k_weights.sizes() == top_k_index.sizes(),
              "routed_experts: top_k_index and top_k_weights must be (tokens, k)");
  const at::Tensor index = top_k_index.to(at::kLong).contiguous();
  const at::Tensor weights = top_k_weights.to(at::kFloat).contiguous().view(-1);
  const int64_t experts = gate_up.size(0), k = index.size(1), pairs = index.numel();
  const int64_t hidden = x.size(1);
  const int64_t* ip = index.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> routed(experts);  // per expert: t * k + s, ascending
  for (int64_t i = 0; i < pairs; ++i)
    if (ip[i] >= 0 && ip[i] < experts) routed[ip[i]].push_back(i);
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  at::Tensor out = at::zeros_like(xc);
  float* op = out.data_ptr<float>();
  for (int64_t e = 0; e < experts; ++e) {
    const std::vector<int64_t>& picks = routed[e];
    if (picks.empty()) continue;
    const int64_t n = static_cast<int64_t>(picks.size());
    at::Tensor rows = at::empty({n, hidden}, xc.options());
    for (int64_t j = 0; j < n; ++j)
      std::copy_n(xp + (picks[j] / k) * hidden, hidden, rows.data_ptr<float>() + j * hidden);
    const at::Tensor both = product(activations, rows, gate_up[e], 2 * intermediate, bits,
                                    half_gate_up);
    at::Tensor inner = at::empty({n, intermediate}, xc.options());
    const float* bp = both.data_ptr<float>();
    float* hp = inner.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < intermediate; ++i)
        hp[j * intermediate + i] = activate(bp[j * 2 * intermediate + i], act) *
                                   bp[j * 2 * intermediate + intermediate + i];
    at::Tensor result = product(activations, inner, down[e], hidden, bits, half_down);
    float* rp = result.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < hidden; ++h) rp[j * hidden + h] *= wp[picks[j]];
    // each weighted row rounded before it is added (the barrier keeps the compiler from
    // fusing the two into one multiply-add): the sum is then the same whatever order two
    // experts come in, as with ATen's index_add_
    asm volatile("" ::: "memory");
    for (int64_t j = 0; j < n; ++j) {
      float* target = op + (picks[j] / k) * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] += rp[j * hidden + h];
    }
  }
  return out;
}

}  // namespace compress_lm

TORCH_LIBRARY_FRAGMENT(compress_lm, m) {
  m.def("routed_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, "
        "Tensor down, int intermediate, int bits, bool half_gate_up, bool half_down, int act, "
        "int activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_lm, CPU, m) {
  m.impl("routed_experts", &compress_lm::routed_experts);
}
