// Greedy / Gumbel-max sampling (see sampling.cuh): one block per row, one pass over the logits that
// tracks the best key and an online log-sum-exp, then a block reduction.
#include <climits>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/sampling.cuh"

namespace moelora::cuda {
namespace {

constexpr int kThreads = 512;

struct Best {
  float key;
  int idx;
};
__device__ __forceinline__ Best better(Best a, Best b) {
  if (b.key > a.key || (b.key == a.key && b.idx < a.idx)) return b;
  return a;
}
struct Lse {
  float m, s;  // sum exp(z - m)
};
__device__ __forceinline__ Lse merge(Lse a, Lse b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return Lse{m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  const int r = blockIdx.x;
  const float* x = p.logits + static_cast<int64_t>(r) * p.ld;
  const float temp = p.temperature ? p.temperature[r] : 0.0f;
  const bool sample = temp > 0.0f;
  const float inv_t = sample ? 1.0f / temp : 1.0f;
  const uint64_t seed = sample ? p.seed[r] : 0, step = sample ? p.step[r] : 0;
  Best best{-INFINITY, INT_MAX};
  Lse lse{-INFINITY, 0.0f};
  for (int i = threadIdx.x; i < p.vocab; i += kThreads) {
    const float v = x[i];
    if (isnan(v)) continue;
    const float z = v * inv_t;
    if (z > lse.m) {
      lse.s = (lse.m == -INFINITY ? 0.0f : lse.s * expf(lse.m - z)) + 1.0f;
      lse.m = z;
    } else {
      lse.s += expf(z - lse.m);
    }
    const float key = sample ? z - logf(-logf(philox_uniform(seed, step, static_cast<uint32_t>(i)))) : v;
    if (key > best.key || best.idx == INT_MAX) best = Best{key, i};  // i grows: ties keep the lower index
  }
  // Warp then block reduction, in a fixed order.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Best ob{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.idx, o)};
    const Lse ol{__shfl_xor_sync(0xffffffffu, lse.m, o), __shfl_xor_sync(0xffffffffu, lse.s, o)};
    best = better(best, ob);
    lse = merge(lse, ol);
  }
  __shared__ Best s_best[kThreads / 32];
  __shared__ Lse s_lse[kThreads / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    s_best[warp] = best;
    s_lse[warp] = lse;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Best b = s_best[0];
    Lse l = s_lse[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      b = better(b, s_best[w]);
      l = merge(l, s_lse[w]);
    }
    const int id = b.idx == INT_MAX ? 0 : b.idx;
    p.ids[r] = id;
    if (p.max_logit) p.max_logit[r] = x[id];
    if (p.logprob) p.logprob[r] = x[id] * inv_t - (l.m + logf(l.s));
  }
}

}  // namespace

void launch_sample(const SampleParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  MOELORA_CHECK(p.vocab > 0 && p.ids != nullptr);
  sample_kernel<<<p.rows, kThreads, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
