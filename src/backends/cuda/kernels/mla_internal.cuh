// What the absorbed MLA's two files share (mla_attention.cu: absorptions, kv_b LoRA, weights;
// mla_latent_attention.cu: the latent attention and its split merge). Internal to them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/mla_attention.cuh"

namespace moelora::cuda::mla_internal {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float bf(const bf16 v) { return __bfloat162float(v); }

__device__ __forceinline__ const int32_t* seq_pages(const MlaAbsorbedParams& p, int t) {
  return p.page_indices + p.page_indptr[p.token_seq[t]];
}

__device__ __forceinline__ bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Step 3 (and 4 where a token's positions span several KV splits) for tokens [t0, t0 + tc) of the
// pass: the attention over the latent cache, its result in lat (normalised), part_o / part_stats
// the splits' partials. `splits` is the plan's grid bound (cuda_plan::MlaPlan::splits).
void launch_latent_attention(const MlaAbsorbedParams& p, int t0, int tc, int splits, float* lat, float* part_o,
                             float* part_stats, cudaStream_t stream);
// The latent kernel's shared-memory opt-in (idempotent; from mla_prepare).
void latent_attention_prepare();

}  // namespace moelora::cuda::mla_internal
