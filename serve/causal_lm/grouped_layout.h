// The record layout the grouped kernels share (grouped_kernels.cpp lays weights out and
// multiplies float32 activations; grouped_int8_activations.cpp multiplies int8 ones).
//
// Output features come in tiles of 16; per tile and group of 32 inputs, one record: the
// codes input by input (16 outputs' codes of input i side by side; at 4 bits inputs 2p and
// 2p + 1 share a byte, low and high nibble), then the 16 scales and 16 offsets, float16 or
// float32.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace compress_lm {

constexpr int64_t GROUP = 32;
constexpr int64_t TILE = 16;  // output features per record
constexpr int64_t ROWS = 8;   // activation rows per pass over a tile

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

// x (..., k) times the packed weight with float32 activations (grouped_kernels.cpp)
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t bits,
                      bool half);

}  // namespace compress_lm
