// The shrink of the dense LoRA that the small-M GEMM's epilogue expands (dense_lora_epilogue.cuh).
// Memory-latency-bound at decode (T x r rows of A, each a few KiB): one warp per (part, token, rank
// row), 16-byte loads with four of them in flight per lane before any use, f32 FMAs, a warp sum.
#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/dense_lora_epilogue.cuh"

namespace moelora::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;  // rank rows per item
constexpr int kInFlight = 4;           // 16-byte loads per lane before the first use

// Item = (part q, token t, block of kWarps rank rows); warp w takes row j = block * kWarps + w.
__global__ void __launch_bounds__(kThreads) dense_lora_shrink_kernel(const __grid_constant__ DenseLoraShrinkParams p) {
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DenseLoraEpilogue& l = p.lora;
  const int jblocks = (p.max_rank + kWarps - 1) / kWarps;
  const int items = l.num_parts * l.M * jblocks;
  float* u_all = const_cast<float*>(l.u);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int jb = item % jblocks, t = (item / jblocks) % l.M, q = item / jblocks / l.M;
    const int s = l.token_slot[t];
    if (s < 0 || s >= l.num_slots) continue;
    const DenseLoraPart& pt = l.parts[q];
    const int r = min(pt.ranks[s], kDenseLoraMaxRank), j = jb * kWarps + warp;
    if (j >= r || pt.a_ptrs[s] == 0) continue;  // uniform over the warp
    const __nv_bfloat16* A = reinterpret_cast<const __nv_bfloat16*>(pt.a_ptrs[s]) + static_cast<int64_t>(j) * p.in;
    const __nv_bfloat16* x = p.x + static_cast<int64_t>(t) * p.ld_x;
    float acc = 0.0f;
    for (int k0 = lane * 8; k0 < p.in; k0 += 32 * 8 * kInFlight) {
      uint4 av[kInFlight], xv[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int k = k0 + i * 32 * 8;
        av[i] = ldg_u4_pred(A + k, k < p.in);
        xv[i] = ldg_u4_pred(x + k, k < p.in);
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        float af[8], xf[8];
        unpack_bf16x8(av[i], af);
        unpack_bf16x8(xv[i], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(af[e], xf[e], acc);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) u_all[(static_cast<int64_t>(q) * l.M + t) * l.ldu + j] = acc;
  }
}

}  // namespace

bool launch_dense_lora_shrink(const DenseLoraShrinkParams& p, cudaStream_t stream) {
  const DenseLoraEpilogue& l = p.lora;
  MOELORA_CHECK(p.x && p.in > 0 && p.in % 8 == 0 && p.ld_x % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0);
  MOELORA_CHECK(l.u && l.token_slot && l.num_parts >= 1 && l.num_parts <= kDenseLoraMaxParts && l.M >= 0);
  MOELORA_CHECK(p.max_rank >= 0 && p.max_rank <= l.ldu && l.ldu <= kDenseLoraMaxRank);
  if (l.M == 0 || p.max_rank == 0) return false;
  const int64_t items = static_cast<int64_t>(l.num_parts) * l.M * ((p.max_rank + kWarps - 1) / kWarps);
  const int grid = static_cast<int>(std::min<int64_t>(items, 4096));  // grid-stride beyond
  launch_kernel(dense_lora_shrink_kernel, dim3(grid), dim3(kThreads), 0, stream, p.pdl, p);
  return true;
}

}  // namespace moelora::cuda
