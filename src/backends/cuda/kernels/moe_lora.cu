// MoE LoRA shrink / expand over virtual-expert tiles (see moe_lora.cuh).
//
// Both are memory-bound at decode (intensity ~ 2 FLOP per factor byte per token of the group), so
// they run on the CUDA cores with f32 accumulation and spend their effort on reading each factor
// once with 16-byte loads: one CTA item covers one tile of <= 16 rows of one (slot, expert)
// group, the rows' accumulators live in registers, and the factor streams past them.
#include <algorithm>

#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_lora.cuh"

namespace moelora::cuda {

namespace {

using namespace moe_detail;

constexpr int LT = kMoeLoraTileRows;
constexpr int kShrinkThreads = 256;  // 8 warps: one A row (rank index) per warp per item
constexpr int kShrinkRows = kShrinkThreads / 32;
constexpr int kExpandThreads = 256;  // two output columns per thread
constexpr int kExpandCols = 2 * kExpandThreads;

__device__ __forceinline__ int slot_rank(const int32_t* rank, int s, int num_slots) {
  return (s >= 0 && s < num_slots) ? min(rank[s], kMoeLoraMaxRank) : 0;
}

// Item i of the per-pair form (MoeLoraPairs): pair i as a one-row tile {expert, start = pair, 1,
// slot}, slot -1 (the "none" group) for an out-of-range slot or expert id. With token_tiles (the
// gate_up shrink), a pair of a slot whose gate_up A is shared by all experts is the token tile
// {-1, token, 1, slot} on the token's first pair and nothing (slot -1) on its others, as moe_align's
// token tiles compute such u rows once per token.
__device__ __forceinline__ MoeTile pair_tile(const MoeLoraPairs& d, const int64_t* a_stride, int num_slots, int i,
                                             bool token_tiles) {
  const int t = i / d.top_k;
  const int s = d.token_slot[t], e = d.ids[i];
  const bool slot_ok = s >= 0 && s < num_slots;
  if (token_tiles && slot_ok && a_stride[s] == 0) return MoeTile{-1, t, 1, i % d.top_k == 0 ? s : -1};
  return MoeTile{e, i, 1, slot_ok && e >= 0 && e < d.E ? s : -1};
}

// One warp: acc[m] = partial dot products of A row `A` (K elements) with x rows s_x[m], m < count
// (lane-partial: the caller reduces over the warp).
__device__ __forceinline__ void shrink_row(const bf16* A, const bf16* x, int64_t ldx, int K, const int* s_x, int count,
                                           int lane, float (&acc)[LT]) {
#pragma unroll
  for (int m = 0; m < LT; ++m) acc[m] = 0.0f;
  if ((reinterpret_cast<uintptr_t>(A) & 15) == 0) {
    // 8 loads of A in flight per lane before any use (run 1: one load per iteration left the
    // shrink latency-bound), then the rows' x (L2-resident, reused by every rank row).
    for (int kb = 0; kb < K; kb += 8 * 256) {
      uint4 av[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int k0 = kb + u * 256 + lane * 8;
        av[u] = k0 < K ? ldg16(A + k0) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int m = 0; m < LT; ++m) {
        if (m < count) {
          const bf16* xr = x + static_cast<int64_t>(s_x[m]) * ldx;
          uint4 xv[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int k0 = kb + u * 256 + lane * 8;
            xv[u] = k0 < K ? ldg16(xr + k0) : make_uint4(0u, 0u, 0u, 0u);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            float af[8], xf[8];
            unpack8(av[u], af);
            unpack8(xv[u], xf);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[m] = fmaf(af[i], xf[i], acc[m]);
          }
        }
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      const float a = __bfloat162float(A[k]);
#pragma unroll
      for (int m = 0; m < LT; ++m)
        if (m < count) acc[m] = fmaf(a, __bfloat162float(x[static_cast<int64_t>(s_x[m]) * ldx + k]), acc[m]);
    }
  }
}

// One thread: out[s_p[m], o0 .. o0+1] = u[m] . B[o0 .. o0+1] for m < count (u rows in s_u).
__device__ __forceinline__ void expand_cols(const bf16* B, int r, int o0, int N, const float (*s_u)[kMoeLoraMaxRank],
                                            const int* s_p, int count, bf16* out) {
  const bf16* B0 = B + static_cast<int64_t>(o0) * r;
  const bf16* B1 = B0 + r;
  float acc0[LT], acc1[LT];
#pragma unroll
  for (int m = 0; m < LT; ++m) acc0[m] = acc1[m] = 0.0f;
  if (r % 8 == 0 && (reinterpret_cast<uintptr_t>(B) & 15) == 0) {
    for (int j0 = 0; j0 < r; j0 += 32) {  // up to 8 row loads in flight per thread
      uint4 v0[4], v1[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + 8 * u;
        v0[u] = j < r ? ldg16(B0 + j) : make_uint4(0u, 0u, 0u, 0u);
        v1[u] = j < r ? ldg16(B1 + j) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + 8 * u;
        if (j >= r) break;
        float b0[8], b1[8];
        unpack8(v0[u], b0);
        unpack8(v1[u], b1);
#pragma unroll
        for (int m = 0; m < LT; ++m) {
          if (m < count) {
            const float4 ua = *reinterpret_cast<const float4*>(&s_u[m][j]);
            const float4 ub = *reinterpret_cast<const float4*>(&s_u[m][j + 4]);
            const float uu[8] = {ua.x, ua.y, ua.z, ua.w, ub.x, ub.y, ub.z, ub.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              acc0[m] = fmaf(uu[i], b0[i], acc0[m]);
              acc1[m] = fmaf(uu[i], b1[i], acc1[m]);
            }
          }
        }
      }
    }
  } else {
    for (int j = 0; j < r; ++j) {
      const float b0 = __bfloat162float(B0[j]), b1 = __bfloat162float(B1[j]);
#pragma unroll
      for (int m = 0; m < LT; ++m) {
        if (m < count) {
          acc0[m] = fmaf(s_u[m][j], b0, acc0[m]);
          acc1[m] = fmaf(s_u[m][j], b1, acc1[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < LT; ++m)
    if (m < count)
      *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(s_p[m]) * N + o0) = pack_bf16x2(acc0[m], acc1[m]);
}

__global__ void __launch_bounds__(kShrinkThreads) moe_lora_shrink_kernel(const __grid_constant__ MoeLoraShrinkParams p) {
  __shared__ int s_x[LT];
  __shared__ int s_o[LT];
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool direct = p.direct.ids != nullptr;
  const int num_tiles = direct ? p.direct.pairs : *p.num_tiles;
  const int jblocks = (p.max_rank + kShrinkRows - 1) / kShrinkRows;
  const int items = num_tiles * jblocks;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const MoeTile t = direct ? pair_tile(p.direct, p.a.stride, p.num_slots, item / jblocks, p.u_tok != nullptr)
                             : p.tiles[item / jblocks];
    const int jb = item % jblocks;
    const int s = t.slot, r = slot_rank(p.a.rank, s, p.num_slots);
    if (jb * kShrinkRows >= r) continue;  // uniform over the CTA
    const bool token_tile = t.expert < 0;
    const int count = min(t.count, LT);
    __syncthreads();  // the previous item's readers of s_x / s_o are done
    if (threadIdx.x < count) {
      const int idx = direct ? t.start : (token_tile ? p.sorted_tokens : p.sorted_pairs)[t.start + threadIdx.x];
      s_x[threadIdx.x] = token_tile ? idx : idx / p.x_row_div;
      s_o[threadIdx.x] = idx;
    }
    __syncthreads();
    const int j = jb * kShrinkRows + warp;
    if (j >= r) continue;  // uniform over the warp; no barrier follows before the next item's
    const bf16* A = reinterpret_cast<const bf16*>(p.a.ptr[s]) + (token_tile ? 0 : t.expert * p.a.stride[s]) +
                    static_cast<int64_t>(j) * p.K;
    float acc[LT];
    shrink_row(A, p.x, p.ldx, p.K, s_x, count, lane, acc);
    float* u = token_tile ? p.u_tok : p.u_pair;
#pragma unroll
    for (int m = 0; m < LT; ++m) {
      if (m < count) {
        const float v = warp_sum(acc[m]);
        if (lane == 0) u[static_cast<int64_t>(s_o[m]) * p.ldu + j] = v;
      }
    }
  }
}

__global__ void __launch_bounds__(kExpandThreads) moe_lora_expand_kernel(const __grid_constant__ MoeLoraExpandParams p) {
  __shared__ __align__(16) float s_u[LT][kMoeLoraMaxRank];
  __shared__ int s_p[LT];
  pdl_wait();
  pdl_trigger();
  const bool direct = p.direct.ids != nullptr;
  const int num_tiles = direct ? p.direct.pairs : *p.num_tiles;
  const int nch = (p.N + kExpandCols - 1) / kExpandCols;
  const int items = num_tiles * nch;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const MoeTile t = direct ? pair_tile(p.direct, nullptr, p.num_slots, item / nch, false) : p.tiles[item / nch];
    const int ch = item % nch;
    const int s = t.slot, r = slot_rank(p.b.rank, s, p.num_slots);
    const int count = min(t.count, LT);
    __syncthreads();  // previous item's readers of s_u / s_p are done
    if (threadIdx.x < count) s_p[threadIdx.x] = direct ? t.start : p.sorted_pairs[t.start + threadIdx.x];
    __syncthreads();
    if (r > 0) {
      const bool token_u = p.a_stride && p.a_stride[s] == 0;
      for (int idx = threadIdx.x; idx < count * r; idx += kExpandThreads) {
        const int m = idx / r, j = idx % r;
        const int64_t row = token_u ? s_p[m] / p.top_k : s_p[m];
        s_u[m][j] = (token_u ? p.u_tok : p.u_pair)[row * p.ldu + j];
      }
    }
    __syncthreads();
    const int o0 = ch * kExpandCols + 2 * threadIdx.x;
    if (o0 >= p.N) continue;
    if (r == 0) {
      for (int m = 0; m < count; ++m)
        *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(s_p[m]) * p.N + o0) = 0u;
      continue;
    }
    const bf16* B = reinterpret_cast<const bf16*>(p.b.ptr[s]) + t.expert * p.b.stride[s];
    expand_cols(B, r, o0, p.N, s_u, s_p, count, p.out);
  }
}

// Shrink + expand of one tile in one CTA: the tile's u rows go through shared memory instead of
// global memory and a second launch. Items are (tile, 512-column chunk); each chunk's CTA redoes
// the tile's (tiny) shrink, whose A comes from HBM once and from L2 for the sibling chunks.
__global__ void __launch_bounds__(kExpandThreads) moe_lora_fused_kernel(const __grid_constant__ MoeLoraFusedParams p) {
  __shared__ __align__(16) float s_u[LT][kMoeLoraMaxRank];
  __shared__ int s_p[LT];
  __shared__ int s_x[LT];
  pdl_wait();
  pdl_trigger();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool direct = p.direct.ids != nullptr;
  const int num_tiles = direct ? p.direct.pairs : *p.num_tiles;
  const int nch = (p.N + kExpandCols - 1) / kExpandCols;
  const int items = num_tiles * nch;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const MoeTile t = direct ? pair_tile(p.direct, nullptr, p.num_slots, item / nch, false) : p.tiles[item / nch];
    const int ch = item % nch;
    const int s = t.slot, r = slot_rank(p.a.rank, s, p.num_slots);
    const int count = min(t.count, LT);
    __syncthreads();  // previous item's readers of s_u / s_p / s_x are done
    if (threadIdx.x < count) {
      const int pr = direct ? t.start : p.sorted_pairs[t.start + threadIdx.x];
      s_p[threadIdx.x] = pr;
      s_x[threadIdx.x] = pr / p.x_row_div;
    }
    __syncthreads();
    if (r > 0) {
      const bf16* A = reinterpret_cast<const bf16*>(p.a.ptr[s]) + t.expert * p.a.stride[s];
      for (int j = warp; j < r; j += kExpandThreads / 32) {
        float acc[LT];
        shrink_row(A + static_cast<int64_t>(j) * p.K, p.x, p.ldx, p.K, s_x, count, lane, acc);
#pragma unroll
        for (int m = 0; m < LT; ++m) {
          if (m < count) {
            const float v = warp_sum(acc[m]);
            if (lane == 0) s_u[m][j] = v;
          }
        }
      }
    }
    __syncthreads();
    const int o0 = ch * kExpandCols + 2 * threadIdx.x;
    if (o0 >= p.N) continue;
    if (r == 0) {
      for (int m = 0; m < count; ++m)
        *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(s_p[m]) * p.N + o0) = 0u;
      continue;
    }
    const bf16* B = reinterpret_cast<const bf16*>(p.b.ptr[s]) + t.expert * p.b.stride[s];
    expand_cols(B, r, o0, p.N, s_u, s_p, count, p.out);
  }
}

bool check_pairs(const MoeLoraPairs& d) {
  return d.token_slot && d.pairs >= 0 && d.top_k >= 1 && d.pairs % d.top_k == 0 && d.E >= 1;
}

}  // namespace

void moe_lora_shrink(const MoeLoraShrinkParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.x && p.K % 8 == 0 && p.ldx % 8 == 0 && p.x_row_div >= 1);
  MOELORA_CHECK(p.direct.ids ? check_pairs(p.direct) : (p.tiles && p.num_tiles && p.sorted_pairs));
  MOELORA_CHECK(p.a.ptr && p.a.stride && p.a.rank && p.u_pair);
  MOELORA_CHECK(!p.sorted_tokens || p.u_tok);  // token tiles (shared A) write u_tok
  MOELORA_CHECK(p.max_rank >= 0 && p.max_rank <= p.ldu && p.max_rank <= kMoeLoraMaxRank);
  const int tiles = p.direct.ids ? p.direct.pairs : p.max_tiles;
  if (tiles == 0 || p.max_rank == 0) return;
  const int64_t items = static_cast<int64_t>(tiles) * ((p.max_rank + kShrinkRows - 1) / kShrinkRows);
  const int grid = static_cast<int>(std::min<int64_t>(items, static_cast<int64_t>(moe_num_sms()) * 8));
  moe_launch(moe_lora_shrink_kernel, dim3(grid), dim3(kShrinkThreads), 0, stream, p.pdl, p);
}

void moe_lora_expand(const MoeLoraExpandParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.N > 0 && p.N % 2 == 0 && p.out && p.top_k >= 1);
  MOELORA_CHECK(p.direct.ids ? check_pairs(p.direct) && p.direct.top_k == p.top_k
                             : (p.tiles && p.num_tiles && p.sorted_pairs));
  MOELORA_CHECK(p.b.ptr && p.b.stride && p.b.rank && p.u_pair && (!p.a_stride || p.u_tok));
  MOELORA_CHECK((reinterpret_cast<uintptr_t>(p.out) & 3) == 0);
  const int tiles = p.direct.ids ? p.direct.pairs : p.max_tiles;
  if (tiles == 0) return;
  const int64_t items = static_cast<int64_t>(tiles) * ((p.N + kExpandCols - 1) / kExpandCols);
  const int grid = static_cast<int>(std::min<int64_t>(items, static_cast<int64_t>(moe_num_sms()) * 8));
  moe_launch(moe_lora_expand_kernel, dim3(grid), dim3(kExpandThreads), 0, stream, p.pdl, p);
}

void moe_lora_fused(const MoeLoraFusedParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.x && p.K % 8 == 0 && p.ldx % 8 == 0 && p.x_row_div >= 1);
  MOELORA_CHECK(p.direct.ids ? check_pairs(p.direct) : (p.tiles && p.num_tiles && p.sorted_pairs));
  MOELORA_CHECK(p.a.ptr && p.a.stride && p.a.rank && p.b.ptr && p.b.stride && p.b.rank && p.out);
  MOELORA_CHECK(p.N > 0 && p.N % 2 == 0 && (reinterpret_cast<uintptr_t>(p.out) & 3) == 0);
  const int tiles = p.direct.ids ? p.direct.pairs : p.max_tiles;
  if (tiles == 0) return;
  const int64_t items = static_cast<int64_t>(tiles) * ((p.N + kExpandCols - 1) / kExpandCols);
  const int grid = static_cast<int>(std::min<int64_t>(items, static_cast<int64_t>(moe_num_sms()) * 8));
  moe_launch(moe_lora_fused_kernel, dim3(grid), dim3(kExpandThreads), 0, stream, p.pdl, p);
}

}  // namespace moelora::cuda
