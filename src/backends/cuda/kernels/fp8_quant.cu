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
  uint8_t* q = p.q + t * p.ld_q;
  float scale;
  if (p.q_lo == nullptr) {
    // Same f32 expressions as the CPU reference (IEEE division), hence the same bits.
    scale = amax > 0.0f ? amax / 448.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c0 + i < p.K) {
        const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
        q[c0 + i] = static_cast<uint8_t>(b);
      }
    }
  } else {
    // Split form: a power-of-two scale (x / scale exact) putting amax in [128, 256); the high term
    // rounds x / scale to e4m3, the low term the (exact, f32) remainder.
    int e = 0;
    frexpf(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
    scale = amax > 0.0f ? ldexpf(1.0f, e - 8) : 1.0f;
    const float inv = 1.0f / scale;  // a power of two: exact
    uint8_t* ql = p.q_lo + t * p.ld_q;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (c0 + i < p.K) {
        const float u = v[i] * inv;
        const __nv_fp8_storage_t hi = __nv_cvt_float_to_fp8(u, __NV_SATFINITE, __NV_E4M3);
        const float hf = __half2float(__half(__nv_cvt_fp8_to_halfraw(hi, __NV_E4M3)));
        const __nv_fp8_storage_t lo = __nv_cvt_float_to_fp8(u - hf, __NV_SATFINITE, __NV_E4M3);
        q[c0 + i] = static_cast<uint8_t>(hi);
        ql[c0 + i] = static_cast<uint8_t>(lo);
      }
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
