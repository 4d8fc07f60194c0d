#include "backends/cuda/kernels/random_fill.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "backends/cuda/cuda_check.h"

namespace moelora::cuda {

namespace {

// splitmix64 of (seed, index): independent values without per-thread state.
__device__ inline uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void random_fill_kernel(RandomFillParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = mix(p.seed * 0x100000001B3ull ^ static_cast<uint64_t>(i));
    const float u = p.scale * (2.0f * static_cast<float>(r >> 40) / 16777216.0f - 1.0f);
    switch (p.type) {
      case RandomFillType::kF32: static_cast<float*>(p.out)[i] = u; break;
      case RandomFillType::kBF16: static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16(u); break;
      case RandomFillType::kFP8: {
        uint8_t code = static_cast<uint8_t>(r);
        if ((code & 0x7f) == 0x7f) code ^= 1;  // 0x7f / 0xff are NaN in e4m3fn
        static_cast<uint8_t*>(p.out)[i] = code;
        break;
      }
    }
  }
}

}  // namespace

void launch_random_fill(const RandomFillParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((p.n + threads - 1) / threads, 132 * 16);
  random_fill_kernel<<<static_cast<int>(blocks), threads, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
