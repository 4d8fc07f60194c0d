// Host + device data of the dense kernel families (elementwise, FP8 quant, dense GEMM, dense LoRA,
// attention, sampling): bf16 device matrices with a row stride whose padding and tail are
// poisoned and checked, and FP8 block quantisation of random weights (what a checkpoint holds).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda_plan/nvfp4_layout.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "gpukit/device_array.h"
#include "gpukit/random.h"
#include "ops/weight_format.h"

namespace moelora::gpukit {

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
          if (fp8_scale_row_block(r, 128, split) != rb) continue;
          for (int c = cb * 128; c < std::min(in, cb * 128 + 128); ++c) amax = std::max(amax, std::fabs(w[r * in + c]));
        }
        const float s = amax > 0.0f ? amax / kFp8E4M3Max : 1.0f;
        scale[rb * col_blocks() + cb] = s;
        for (int r = 0; r < out; ++r) {
          if (fp8_scale_row_block(r, 128, split) != rb) continue;
          for (int c = cb * 128; c < std::min(in, cb * 128 + 128); ++c)
            q[static_cast<size_t>(r) * in + c] = f32_to_fp8e4m3(w[r * in + c] / s);
        }
      }
    }
    deq.resize(w.size());
    dequantize_fp8_block(q.data(), out, in, scale.data(), 128, 128, split, deq.data());
  }
};

// Random NVFP4 weight [out, in] as a checkpoint holds it: codes (any byte), e4m3 group scales and
// a global scale per part (rows [0, split) and [split, out) stand for two fused projections with
// their own weight_scale_2); `deq` is the executable spec's dequantisation. `codes_packed`,
// `global_rows` are what the CUDA upload makes of it (cuda_plan/nvfp4_layout.h).
struct Nvfp4Weight {
  int out = 0, in = 0, split = 0;
  std::vector<uint8_t> q, scale;  // [out, in / 2], [out, in / 16]
  float global[2] = {1.0f, 1.0f};
  std::vector<float> deq;
  std::vector<uint8_t> codes_packed;
  std::vector<float> global_rows;  // weight_scale_2 * 2^26 per row
  void generate(Rng& rng, int out_, int in_, int split_ = 0) {
    out = out_, in = in_, split = split_;
    q.resize(static_cast<size_t>(out) * in / 2);
    for (auto& b : q) b = static_cast<uint8_t>(rng.integer(0, 255));
    scale.resize(static_cast<size_t>(out) * in / 16);
    for (auto& s : scale) s = f32_to_fp8e4m3(rng.uniform(16.0f, 64.0f));
    // Weights of about N(0, 1/sqrt(in))'s size (|e2m1| averages ~2.3).
    for (float& g : global) g = rng.uniform(0.75f, 1.25f) / (2.3f * 32.0f * std::sqrt(static_cast<float>(in)));
    deq.resize(static_cast<size_t>(out) * in);
    global_rows.resize(out);
    const int parts[2][2] = {{0, split > 0 ? split : out}, {split > 0 ? split : out, out}};
    for (int p = 0; p < 2; ++p) {
      const int r0 = parts[p][0], rows = parts[p][1] - parts[p][0];
      if (rows <= 0) continue;
      dequantize_nvfp4(q.data() + static_cast<size_t>(r0) * in / 2, rows, in, scale.data() + static_cast<size_t>(r0) * in / 16,
                       global[p], deq.data() + static_cast<size_t>(r0) * in);
      for (int r = r0; r < r0 + rows; ++r) global_rows[r] = global[p] * cuda_plan::kNvfp4GlobalFactor;
    }
    codes_packed.resize(q.size());
    cuda_plan::nvfp4_pack_codes(q.data(), out, in, codes_packed.data());
  }
};

// cpu::fp8_activation_round_trip (what a W8A8 GEMM multiplies instead of x) in f32, packed
// [rows, cols]: the references of the FP8-activation paths feed this instead of x.
inline std::vector<float> fp8_activation_round_trip(const float* x, int64_t ld, int rows, int cols) {
  std::vector<double> d(static_cast<size_t>(rows) * cols);
  cpu::fp8_activation_round_trip(x, ld, rows, cols, d.data());
  return std::vector<float>(d.begin(), d.end());
}

// cpu::lora_add's table over host f32 factors, slot s: A a[s] [ranks[s], in], B b[s] [out, ranks[s]]
// (the reference side of every dense LoRA check).
inline LoraModuleTable host_lora_table(int in, int out, const std::vector<const float*>& a,
                                       const std::vector<const float*>& b, const std::vector<int>& ranks) {
  const int n = static_cast<int>(ranks.size());
  LoraModuleTable tab;
  tab.num_slots = n, tab.in = in, tab.out = out;
  tab.a_ptrs = Tensor::empty_host(DType::kI64, {n});
  tab.b_ptrs = Tensor::empty_host(DType::kI64, {n});
  tab.ranks = Tensor::empty_host(DType::kI32, {n});
  for (int s = 0; s < n; ++s) {
    tab.a_ptrs.ptr<int64_t>()[s] = reinterpret_cast<int64_t>(a[s]);
    tab.b_ptrs.ptr<int64_t>()[s] = reinterpret_cast<int64_t>(b[s]);
    tab.ranks.ptr<int32_t>()[s] = ranks[s];
  }
  return tab;
}

}  // namespace moelora::gpukit
