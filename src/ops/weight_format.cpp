#include "ops/weight_format.h"

#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "core/dtype.h"

namespace moelora {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

DType WeightFormat::storage_dtype() const {
  switch (encoding) {
    case WeightEncoding::kFp8Block: return DType::kF8E4M3;
    case WeightEncoding::kNvfp4: return DType::kU8;
    case WeightEncoding::kDense: break;
  }
  return DType::kBF16;
}

std::vector<int64_t> WeightFormat::stored_shape(int out, int in) const {
  if (is_nvfp4()) return {out, in / 2};
  return {out, in};
}

std::vector<int64_t> WeightFormat::scale_shape(int out, int in) const {
  switch (encoding) {
    case WeightEncoding::kFp8Block: return {ceil_div(out, block_out), ceil_div(in, block_in)};
    case WeightEncoding::kNvfp4: return {out, in / block_in};
    case WeightEncoding::kDense: break;
  }
  return {};
}

double WeightFormat::bytes_per_weight() const {
  switch (encoding) {
    case WeightEncoding::kFp8Block: return 1.0 + 4.0 / (static_cast<double>(block_out) * block_in);
    case WeightEncoding::kNvfp4: return 0.5 + 1.0 / block_in;
    case WeightEncoding::kDense: break;
  }
  return 2.0;
}

std::string WeightFormat::describe() const {
  switch (encoding) {
    case WeightEncoding::kFp8Block: return fmt::format("FP8 e4m3 ({}x{} block scales)", block_out, block_in);
    case WeightEncoding::kNvfp4: return fmt::format("NVFP4 (e2m1, {}-value groups)", block_in);
    case WeightEncoding::kDense: break;
  }
  return "bf16";
}

StoredWeight dense_weight(const Tensor& w) {
  MOELORA_CHECK(w.ndim() == 2);
  StoredWeight s;
  s.data = w;
  s.out = static_cast<int>(w.dim(0));
  s.in = static_cast<int>(w.dim(1));
  return s;
}

Status validate_stored_weight(const StoredWeight& w, const std::string& what) {
  const WeightFormat& f = w.format;
  const auto shape = f.stored_shape(w.out, w.in);
  if (f.is_nvfp4() && w.in % f.block_in != 0)
    return invalid_argument("{}: {} needs the input width ({}) to be a multiple of {}", what, f.describe(), w.in,
                            f.block_in);
  if (w.data.shape() != shape)
    return invalid_argument("{}: weight has shape {} but {} implies [{}]", what, w.data.shape_string(), f.describe(),
                            fmt::join(shape, ", "));
  if (f.is_dense()) {
    if (!is_float_dtype(w.data.dtype()) || w.data.dtype() == DType::kF8E4M3)
      return invalid_argument("{}: weight has dtype {}, not a float type", what, dtype_name(w.data.dtype()));
    return {};
  }
  if (w.data.dtype() != f.storage_dtype())
    return invalid_argument("{}: weight has dtype {} but {} stores {}", what, dtype_name(w.data.dtype()),
                            f.describe(), dtype_name(f.storage_dtype()));
  if (!w.scale.defined()) return invalid_argument("{}: {} weight without its block scales", what, f.describe());
  const auto sshape = f.scale_shape(w.out, w.in);
  if (w.scale.shape() != sshape)
    return invalid_argument("{}: block scales have shape {} but {} implies [{}]", what, w.scale.shape_string(),
                            f.describe(), fmt::join(sshape, ", "));
  if (f.is_fp8() && w.scale.dtype() != DType::kF32 && w.scale.dtype() != DType::kBF16)
    return invalid_argument("{}: FP8 block scales must be F32 or BF16, not {}", what, dtype_name(w.scale.dtype()));
  if (f.is_nvfp4()) {
    if (w.scale.dtype() != DType::kF8E4M3)
      return invalid_argument("{}: NVFP4 block scales must be F8_E4M3, not {}", what, dtype_name(w.scale.dtype()));
    // A NaN or negative group scale would silently poison or flip a whole group.
    const auto* s = w.scale.ptr<uint8_t>();
    for (int64_t i = 0; i < w.scale.numel(); ++i)
      if ((s[i] & 0x7f) == 0x7f || (s[i] & 0x80))
        return invalid_argument("{}: NVFP4 block scale {} is {} (must be finite and >= 0)", what, i,
                                (s[i] & 0x7f) == 0x7f ? "NaN" : "negative");
    if (!std::isfinite(w.global_scale) || w.global_scale <= 0.0f)
      return invalid_argument("{}: NVFP4 global scale (weight_scale_2) is {}, must be finite and > 0", what,
                              w.global_scale);
  }
  return {};
}

void dequantize_fp8_block(const uint8_t* q, int rows, int cols, const float* scale_inv, int block_out,
                          int block_in, int split_rows, float* out) {
  const int col_blocks = (cols + block_in - 1) / block_in;
  for (int i = 0; i < rows; ++i) {
    const float* srow = scale_inv + static_cast<int64_t>(fp8_scale_row_block(i, block_out, split_rows)) * col_blocks;
    for (int j = 0; j < cols; ++j) {
      const int64_t idx = static_cast<int64_t>(i) * cols + j;
      out[idx] = fp8e4m3_to_f32(q[idx]) * srow[j / block_in];
    }
  }
}

void dequantize_nvfp4(const uint8_t* packed, int rows, int cols, const uint8_t* block_scales, float global_scale,
                      float* out, int group) {
  MOELORA_CHECK_MSG(group > 0 && cols % group == 0 && cols % 2 == 0,
                    "NVFP4 rows hold whole groups of {} values, got {} columns", group, cols);
  const int groups = cols / group;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const uint8_t byte = packed[static_cast<int64_t>(i) * (cols / 2) + j / 2];
      const uint8_t code = (j % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      const float block =
          fp4e2m1_to_f32(code) * fp8e4m3_to_f32(block_scales[static_cast<int64_t>(i) * groups + j / group]);
      out[static_cast<int64_t>(i) * cols + j] = block * global_scale;
    }
}

Tensor dequantize_to_f32(const StoredWeight& w) {
  const WeightFormat& f = w.format;
  if (f.is_dense()) return to_f32(w.data);
  Tensor out = Tensor::empty_host(DType::kF32, {w.out, w.in});
  if (f.is_fp8()) {
    Tensor scale = to_f32(w.scale);
    dequantize_fp8_block(w.data.ptr<uint8_t>(), w.out, w.in, scale.ptr<float>(), f.block_out, f.block_in, 0,
                         out.ptr<float>());
  } else {
    dequantize_nvfp4(w.data.ptr<uint8_t>(), w.out, w.in, w.scale.ptr<uint8_t>(), w.global_scale, out.ptr<float>(),
                     f.block_in);
  }
  return out;
}

}  // namespace moelora
