// Deterministic pseudo-random fill on the device (benchmarks build full-size models with random
// weights without moving tens of gigabytes from the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

enum class RandomFillType : int32_t { kF32 = 0, kBF16 = 1, kFP8 = 2 };

struct RandomFillParams {
  void* out = nullptr;
  int64_t n = 0;
  RandomFillType type = RandomFillType::kF32;
  uint64_t seed = 0;
  float scale = 1.0f;  // floats: uniform in [-scale, scale]; FP8: any finite code
};
void launch_random_fill(const RandomFillParams& p, cudaStream_t stream);

}  // namespace moelora::cuda
