// What the paged-attention kernels share (attention.cu: cache write, prefill, the split combine;
// attention_decode.cu: decode). Not part of the backend's interface: launches go through
// attention.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda::attention_detail {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

struct KParams {
  AttentionParams a;
  float scale_log2;
  int group;       // query heads per kv head
  int head_tiles;  // decode blocks along a kv head's query heads (cuda_plan::attention_decode_heads_per_block)
  int max_splits;  // the grid's split extent; a token's own splits: cuda_plan::attention_token_split
  int stages;      // decode: K/V tiles per warp in shared memory
  int ps_shift;    // log2(page_size) when a power of two, else -1
  bool tile_in_page;  // page_size % 16 == 0: a 16-position tile aligned to 16 lies in one page
  float* ws;
  const int32_t* items;
  int tokens_per_item;
};

__device__ __forceinline__ int page_of(const KParams& p, int pos) {
  return p.ps_shift >= 0 ? pos >> p.ps_shift : pos / p.a.page_size;
}

__device__ __forceinline__ int64_t cache_row(const KParams& p, int seq_base, int pos) {
  const int pi = page_of(p, pos);
  return static_cast<int64_t>(p.a.page_indices[seq_base + pi]) * p.a.page_size + (pos - pi * p.a.page_size);
}

// One tile's step of the online softmax (f32, exp2 domain) for the two rows a lane holds in an
// MMA accumulator layout: s[j][e] is row g + 8 (e / 2) (g = lane / 4), already scaled and masked
// (-inf), and the row's NB * 2 scores in a lane are a quarter of the tile's (the quad's lanes hold
// the rest). Updates the running maxima m and sums l, turns s into exp2(s - max) and returns in
// al0 / al1 the factors by which the rows' output accumulators are to be rescaled.
template <int NB>
__device__ __forceinline__ void online_softmax_step(float (&s)[NB][4], float (&m)[2], float (&l)[2], float& al0,
                                                    float& al1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    mx0 = fmaxf(fmaxf(mx0, s[j][0]), s[j][1]);
    mx1 = fmaxf(fmaxf(mx1, s[j][2]), s[j][3]);
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);
  // A row that has seen no key yet keeps max -inf; subtracting 0 then keeps every term 0.
  const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
  al0 = exp2f(m[0] - b0);
  al1 = exp2f(m[1] - b1);
  m[0] = mn0;
  m[1] = mn1;
  float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    s[j][0] = exp2f(s[j][0] - b0);
    s[j][1] = exp2f(s[j][1] - b0);
    s[j][2] = exp2f(s[j][2] - b1);
    s[j][3] = exp2f(s[j][3] - b1);
    ps0 += s[j][0] + s[j][1];
    ps1 += s[j][2] + s[j][3];
  }
  l[0] = l[0] * al0 + ps0;
  l[1] = l[1] * al1 + ps1;
}

// After the last tile: the rows' softmax sums over their quad, and the factors that normalise the
// rows' outputs (0 for a row past the block's end, which is not stored).
__device__ __forceinline__ void row_normalisers(float (&l)[2], bool v0, bool v1, float& inv0, float& inv1) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  inv0 = v0 ? 1.0f / l[0] : 0.0f;
  inv1 = v1 ? 1.0f / l[1] : 0.0f;
}

// cp_async, ldmatrix_x4 and smem_addr: backends/cuda/cuda_utils.cuh.

// The decode kernel (attention_decode.cu), instantiated there for cuda_plan::kTensorCoreHeadDims;
// decode_prepare raises its shared-memory limits.
template <int DK, int DV>
void launch_decode(const KParams& k, cudaStream_t stream);
template <int DK, int DV>
void decode_prepare();
// The wgmma prefill kernel (attention_prefill_wgmma.cu), instantiated for the head dims
// cuda_plan::attention_prefill_wgmma_built lists; prefill_wgmma_prepare raises its shared-memory limit.
template <int DK, int DV>
void launch_prefill_wgmma(const KParams& k, int num_items, cudaStream_t stream);
template <int DK, int DV>
void prefill_wgmma_prepare();
// The generic kernel (attention_generic.cu): every token, any head dims choose_attention_kernel allows.
void launch_generic(const KParams& k, cudaStream_t stream);

}  // namespace moelora::cuda::attention_detail
