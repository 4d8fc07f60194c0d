// Helpers shared by the op-suite cases of the dense kernel families (elementwise, FP8 quant, dense
// GEMM, dense LoRA, attention, sampling): bf16 device matrices with a row stride whose padding and
// tail are poisoned and checked, FP8 block quantisation of random weights, and case naming.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"
#include "core/dtype.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {

// gtest parameter names allow [A-Za-z0-9_] only: the printed case name with the rest mapped to '_'.
inline std::string gtest_safe(const std::string& s) {
  std::string o;
  for (char c : s) o += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  while (!o.empty() && o.back() == '_') o.pop_back();
  return o;
}

// A bf16 matrix [rows, cols] with row stride ld on the device; host copy holds the exact values.
struct DevMat {
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<float> host;  // [rows, cols] packed, exactly the bf16 values on the device
  DeviceArray<uint16_t> dev;

  DevMat() = default;
  DevMat(int64_t r, int64_t c, int64_t ld_ = 0) : rows(r), cols(c), ld(ld_ > 0 ? ld_ : c), host(r * c, 0.0f) {
    dev = DeviceArray<uint16_t>(static_cast<size_t>(std::max<int64_t>(rows * ld, 1)));
  }
  __nv_bfloat16* ptr() const { return reinterpret_cast<__nv_bfloat16*>(dev.get()); }
  // Fills with N(0, stddev) rounded to bf16 and uploads; the row padding keeps the poison.
  void randomize(Rng& rng, float stddev = 1.0f) {
    for (auto& x : host) x = bf16_to_f32(f32_to_bf16(rng.normal(stddev)));
    upload();
  }
  void upload() {
    std::vector<uint16_t> full = dev.download();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) full[r * ld + c] = f32_to_bf16(host[r * cols + c]);
    dev.upload(full);
  }
  // The device contents [rows, cols] as floats.
  std::vector<float> download() const {
    std::vector<uint16_t> full = dev.download();
    std::vector<float> o(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = bf16_to_f32(full[r * ld + c]);
    return o;
  }
  // Poison padding columns and the guard survived (0xA5A5 is what DeviceArray starts with).
  bool padding_intact() const {
    if (!dev.guard_intact()) return false;
    std::vector<uint16_t> full = dev.download();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = cols; c < ld; ++c)
        if (full[r * ld + c] != 0xA5A5) return false;
    return true;
  }
};

// Random weight [out, in] quantised to e4m3 with one f32 scale per 128x128 block (DeepSeek style,
// partial edge blocks keep their own amax). With split > 0 rows [0, split) and [split, out) are
// quantised as two matrices whose scale rows are stacked (LinearWeight::split_rows).
struct Fp8Weight {
  int out = 0, in = 0, split = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale;  // [row_blocks, ceil(in / 128)]
  std::vector<float> deq;    // exact dequantised values [out, in]
  int col_blocks() const { return (in + 127) / 128; }
  int row_blocks() const {
    if (split <= 0) return (out + 127) / 128;
    return (split + 127) / 128 + (out - split + 127) / 128;
  }
  void generate(Rng& rng, int out_, int in_, int split_ = 0) {
    out = out_, in = in_, split = split_;
    std::vector<float> w(static_cast<size_t>(out) * in);
    for (auto& x : w) x = rng.normal(1.0f / std::sqrt(static_cast<float>(in)));
    // A few exact zeros and tiny values exercise zero / subnormal codes.
    for (size_t i = 0; i < w.size(); i += 97) w[i] = 0.0f;
    for (size_t i = 5; i < w.size(); i += 89) w[i] *= 1e-4f;
    q.assign(w.size(), 0);
    scale.assign(static_cast<size_t>(row_blocks()) * col_blocks(), 1.0f);
    for (int rb = 0; rb < row_blocks(); ++rb) {
      for (int cb = 0; cb < col_blocks(); ++cb) {
        float amax = 0.0f;
        for (int r = 0; r < out; ++r) {
          if (cpu::scale_row_block(r, 128, split) != rb) continue;
          for (int c = cb * 128; c < std::min(in, cb * 128 + 128); ++c) amax = std::max(amax, std::fabs(w[r * in + c]));
        }
        const float s = amax > 0.0f ? amax / kFp8E4M3Max : 1.0f;
        scale[rb * col_blocks() + cb] = s;
        for (int r = 0; r < out; ++r) {
          if (cpu::scale_row_block(r, 128, split) != rb) continue;
          for (int c = cb * 128; c < std::min(in, cb * 128 + 128); ++c)
            q[static_cast<size_t>(r) * in + c] = f32_to_fp8e4m3(w[r * in + c] / s);
        }
      }
    }
    deq.resize(w.size());
    cpu::dequantize_fp8_block(q.data(), out, in, scale.data(), 128, 128, split, deq.data());
  }
};

inline std::vector<float> bf16_round(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

}  // namespace moelora::ops_test
