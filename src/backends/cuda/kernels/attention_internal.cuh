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

// cp.async of SZ bytes (4, 8 or 16); pred false writes zeros and reads nothing.
template <int SZ>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src = pred ? SZ : 0;
  if constexpr (SZ == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(SZ), "r"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

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
