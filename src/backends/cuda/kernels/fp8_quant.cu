// Activation quantisation (see fp8_quant.cuh): one warp per (token, 128-channel group); each lane
// holds 4 channels, so the group's amax is one warp reduction and nothing is read twice.
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"

namespace moelora::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void fp8_quant_kernel(Fp8QuantParams p) {
  const int groups = ceil_div(p.K, kFp8Group);
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (gid >= static_cast<int64_t>(p.M) * groups) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = gid / groups;
  const int g = static_cast<int>(gid % groups);
  const int c0 = g * kFp8Group + lane * 4;
  const bf16* x = p.x + t * p.ld_x;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = c0 + i < p.K ? __bfloat162float(x[c0 + i]) : 0.0f;
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = warp_max(amax);
  // Same f32 expressions as the CPU reference (IEEE division), hence the same bits.
  const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
  uint8_t* q = p.q + t * p.ld_q;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (c0 + i < p.K) {
      const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
      q[c0 + i] = static_cast<uint8_t>(b);
    }
  }
  if (lane == 0) {
    const int64_t si = p.layout == Fp8ScaleLayout::kTokenMajor ? t * p.scale_ld + g : g * p.scale_ld + t;
    p.scales[si] = scale;
  }
}

}  // namespace

void launch_fp8_quant_per_token(const Fp8QuantParams& p, cudaStream_t stream) {
  if (p.M == 0 || p.K == 0) return;
  const int groups = ceil_div(p.K, kFp8Group);
  MOELORA_CHECK(p.layout == Fp8ScaleLayout::kTokenMajor ? p.scale_ld >= groups : p.scale_ld >= p.M);
  const int64_t warps = static_cast<int64_t>(p.M) * groups;
  fp8_quant_kernel<<<static_cast<unsigned>(ceil_div64(warps, kWarpsPerBlock)), kWarpsPerBlock * 32, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
