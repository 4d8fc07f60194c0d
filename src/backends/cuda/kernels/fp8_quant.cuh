// Per-token, per-128-channel FP8 (e4m3) quantisation of bf16 activations: what an FP8 GEMM with
// DeepSeek-style 1x128 activation scales consumes. Bit-exact with
// cpu::quantize_fp8_per_token_group: scale = amax / 448 (a zero group keeps scale 1),
// q = e4m3(x / scale) rounded to nearest even with saturation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

enum class Fp8ScaleLayout : uint8_t {
  kTokenMajor,  // scales[t * scale_ld + g]   (scale_ld >= groups)
  kGroupMajor,  // scales[g * scale_ld + t]   (scale_ld >= M): cuBLASLt VEC128 for operand B
};

struct Fp8QuantParams {
  const __nv_bfloat16* x = nullptr;  // [M, K], row stride ld_x
  int64_t ld_x = 0;
  int M = 0;
  int K = 0;  // groups = ceil(K / 128); a partial last group uses its own amax
  uint8_t* q = nullptr;  // [M, K] e4m3, row stride ld_q (bytes)
  int64_t ld_q = 0;
  float* scales = nullptr;
  int64_t scale_ld = 0;
  Fp8ScaleLayout layout = Fp8ScaleLayout::kTokenMajor;
  // Split form (non-null): x = scale * (q + q_lo) with two e4m3 terms, the activations of the
  // wgmma MoE GEMM's W8A16 path (moe_gemm_wgmma.cu). scale is the power of two that puts the
  // group's amax in [128, 256), q = e4m3(x / scale) and q_lo = e4m3(x / scale - q), both rounded
  // to nearest. For bf16 x (8 significant bits) the sum is exact for every element within 2^9 of the
  // group's amax, and off by at most 2^-10 * scale (< 2^-17 of the amax) below that (e4m3's
  // smallest step is 2^-9): docs/numerics.md.
  uint8_t* q_lo = nullptr;
};
constexpr int kFp8Group = 128;
void launch_fp8_quant_per_token(const Fp8QuantParams& p, cudaStream_t stream);

}  // namespace moelora::cuda
