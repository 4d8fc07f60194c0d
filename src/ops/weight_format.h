// How a checkpoint stores a linear weight, in one place: the loader reads it to know which tensors
// to expect and how to check them, the CPU reference to dequantise, the CUDA upload and the kernel
// choice to pick a path, and the benchmarks for the bytes a weight costs.
//
// Formats (docs/numerics.md "Weight formats"):
//   dense      any float dtype, no scales.
//   FP8 block  F8_E4M3 [out, in] + `weight_scale_inv` [ceil(out/bo), ceil(in/bi)] f32/bf16 (DeepSeek);
//              W = q * scale_inv[i / bo][j / bi].
//   NVFP4      U8 [out, in/2] (two e2m1 codes per byte, element 2j in the low nibble) +
//              `weight_scale` F8_E4M3 [out, in/16] + `weight_scale_2` f32 scalar (ModelOpt);
//              W = e2m1(q) * e4m3(scale[i][j/16]) * weight_scale_2.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace moelora {

enum class WeightEncoding : uint8_t { kDense, kFp8Block, kNvfp4 };

struct WeightFormat {
  WeightEncoding encoding = WeightEncoding::kDense;
  // One scale per block_out x block_in weights: FP8 128 x 128 (DeepSeek's default), NVFP4 1 x 16.
  int block_out = 1;
  int block_in = 1;

  static WeightFormat dense() { return {}; }
  static WeightFormat fp8_block(int block_out, int block_in) {
    return {WeightEncoding::kFp8Block, block_out, block_in};
  }
  static WeightFormat nvfp4(int group = 16) { return {WeightEncoding::kNvfp4, 1, group}; }

  bool is_dense() const { return encoding == WeightEncoding::kDense; }
  bool is_fp8() const { return encoding == WeightEncoding::kFp8Block; }
  bool is_nvfp4() const { return encoding == WeightEncoding::kNvfp4; }
  // The dtype of the stored weight tensor (dense: any float, reported as BF16).
  DType storage_dtype() const;
  // Shapes in the file for a logical [out, in] weight.
  std::vector<int64_t> stored_shape(int out, int in) const;
  std::vector<int64_t> scale_shape(int out, int in) const;
  // Bytes per weight element in memory, block scales included (what a GEMV must read).
  double bytes_per_weight() const;
  // "bf16", "FP8 e4m3 (128x128 block scales)", "NVFP4 (e2m1, 16-value groups)".
  std::string describe() const;
  bool operator==(const WeightFormat&) const = default;
};

// A linear weight as the checkpoint holds it (host tensors, mapped from the file), before a
// backend takes it.
struct StoredWeight {
  WeightFormat format;
  Tensor data;               // dense [out, in] float; FP8 [out, in]; NVFP4 [out, in / 2] U8
  Tensor scale;              // FP8: scale_inv (f32/bf16); NVFP4: [out, in / 16] F8_E4M3; dense: none
  float global_scale = 1.0f;  // NVFP4 weight_scale_2
  int out = 0;
  int in = 0;
};

// A dense StoredWeight around a float tensor [out, in].
StoredWeight dense_weight(const Tensor& w);

// Checks shapes and dtypes of `w` against its format (loader messages name `what`).
Status validate_stored_weight(const StoredWeight& w, const std::string& what);

// The weight as f32 [out, in] on the host: the executable spec of every format.
Tensor dequantize_to_f32(const StoredWeight& w);

// ---- The dequantisation kernels themselves (host, exact as documented).
// Row block of FP8 scale row `row` when rows [0, split_rows) and [split_rows, rows) were quantised
// as separate matrices (see LinearWeight::split_rows); split_rows <= 0: one matrix. constexpr, so
// the CUDA kernels (built with --expt-relaxed-constexpr) call this same definition on the device.
constexpr int fp8_scale_row_block(int row, int block_out, int split_rows) {
  if (split_rows <= 0 || row < split_rows) return row / block_out;
  return (split_rows + block_out - 1) / block_out + (row - split_rows) / block_out;
}
// W[i][j] = q[i][j] * scale_inv[row_block(i)][j / block_in].
void dequantize_fp8_block(const uint8_t* q, int rows, int cols, const float* scale_inv, int block_out,
                          int block_in, int split_rows, float* out);
// NVFP4: W[i][j] = e2m1(q[i][j]) * e4m3(scale[i][j / group]) * global_scale, computed as
// (e2m1 * scale) in f32 (exact: 2 x 4 significant bits) times the global scale, so the only
// rounding is the last product's. cols % group == 0. A NaN scale gives NaN (loaders refuse it).
void dequantize_nvfp4(const uint8_t* packed, int rows, int cols, const uint8_t* block_scales, float global_scale,
                      float* out, int group = 16);

}  // namespace moelora
