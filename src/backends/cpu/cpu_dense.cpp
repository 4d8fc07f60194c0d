// CPU reference: dense projections, LoRA, norms, activations, FP8 activation quantisation.
// (Weight dequantisation is ops/weight_format.h.)
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"
#include "core/dtype.h"

namespace moelora::cpu {

void fp8_activation_round_trip(const float* x, int64_t ld, int64_t rows, int cols, double* out) {
  const int groups = (cols + 127) / 128;
  std::vector<float> s(groups);
  std::vector<uint8_t> q(cols);
  for (int64_t t = 0; t < rows; ++t) {
    quantize_fp8_per_token_group(x + t * ld, 1, cols, 128, q.data(), s.data());
    for (int c = 0; c < cols; ++c) out[t * cols + c] = static_cast<double>(fp8e4m3_to_f32(q[c])) * s[c / 128];
  }
}

void quantize_fp8_per_token_group(const float* x, int64_t rows, int cols, int group, uint8_t* q,
                                  float* scales) {
  const int groups = (cols + group - 1) / group;
  for (int64_t t = 0; t < rows; ++t) {
    for (int g = 0; g < groups; ++g) {
      const int c0 = g * group, c1 = std::min(cols, c0 + group);
      float amax = 0.0f;
      for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[t * cols + c]));
      // A zero group keeps scale 1 so that dequantisation reproduces zeros without 0/0.
      const float scale = amax > 0.0f ? amax / kFp8E4M3Max : 1.0f;
      scales[t * groups + g] = scale;
      for (int c = c0; c < c1; ++c) q[t * cols + c] = f32_to_fp8e4m3(x[t * cols + c] / scale);
    }
  }
}

void linear(const float* x, int64_t ldx, int64_t T, const float* w, int out, int in, float* y, int64_t ldy) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * ldx;
    for (int o = 0; o < out; ++o) {
      const float* wr = w + static_cast<int64_t>(o) * in;
      double acc = 0.0;
      for (int i = 0; i < in; ++i) acc += static_cast<double>(xr[i]) * wr[i];
      y[t * ldy + o] = static_cast<float>(acc);
    }
  }
}

void lora_add(const float* x, int64_t ldx, int64_t T, const int32_t* slot, const LoraModuleTable& table,
              float* y, int64_t ldy) {
  const int64_t* a_ptrs = table.a_ptrs.ptr<int64_t>();
  const int64_t* b_ptrs = table.b_ptrs.ptr<int64_t>();
  const int32_t* ranks = table.ranks.ptr<int32_t>();
  std::vector<double> u;
  for (int64_t t = 0; t < T; ++t) {
    const int s = slot[t];
    if (s < 0) continue;
    MOELORA_CHECK_MSG(s < table.num_slots, "token slot {} outside {} slots", s, table.num_slots);
    const int r = ranks[s];
    if (r == 0) continue;
    const auto* A = reinterpret_cast<const float*>(a_ptrs[s]);
    const auto* B = reinterpret_cast<const float*>(b_ptrs[s]);
    const float* xr = x + t * ldx;
    u.assign(r, 0.0);
    for (int k = 0; k < r; ++k) {
      const float* ar = A + static_cast<int64_t>(k) * table.in;
      double acc = 0.0;
      for (int i = 0; i < table.in; ++i) acc += static_cast<double>(xr[i]) * ar[i];
      u[k] = acc;
    }
    float* yr = y + t * ldy;
    for (int o = 0; o < table.out; ++o) {
      const float* br = B + static_cast<int64_t>(o) * r;
      double acc = 0.0;
      for (int k = 0; k < r; ++k) acc += u[k] * br[k];
      yr[o] = static_cast<float>(yr[o] + acc);
    }
  }
}

void rmsnorm(const float* x, int64_t ldx, int64_t T, int cols, const float* w, int group, float eps,
             float* y, int64_t ldy) {
  MOELORA_CHECK(group > 0 && cols % group == 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int g0 = 0; g0 < cols; g0 += group) {
      const float* xr = x + t * ldx + g0;
      double ss = 0.0;
      for (int i = 0; i < group; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const double inv = 1.0 / std::sqrt(ss / group + eps);
      float* yr = y + t * ldy + g0;
      for (int i = 0; i < group; ++i) yr[i] = static_cast<float>(xr[i] * inv * w[i]);
    }
  }
}

void silu_mul(const float* gate, int64_t ldg, const float* up, int64_t ldu, int64_t T, int cols, float* out,
              int64_t ldo) {
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < cols; ++i) {
      const double g = gate[t * ldg + i];
      out[t * ldo + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[t * ldu + i]);
    }
  }
}

}  // namespace moelora::cpu
