// DeepSeek MLA, absorbed form (see mla_attention.cuh for the math and the kernel sequence).
//
// Why this shape of kernels:
// - The two absorptions are, per head, GEMMs over the step's tokens (qc = q_nope W_UK_h,
//   out = o W_UV_h^T): absorb_kernel takes one head, a chunk of output columns and up to 64 tokens,
//   on bf16 tensor cores (mma.sync m16n8k16), the weight chunk streamed through shared memory by
//   cp.async in 128-deep slices. At decode sizes they are weight streams (16 MiB of bf16 per
//   absorption at DeepSeek-V3's shapes), so the column chunk is narrow there for many blocks in
//   flight, and wide for long prefills so that the float32 latent output is read once per head
//   (cuda_plan::choose_mla_plan).
// - The attention is MQA with one R + rope wide "KV head" (the latent row, shared by every query
//   head), so it is a GEMM per token too: S = Q K^T over the token's heads (the MMA's rows, 16 per
//   warp) and 64 cached positions per shared-memory tile, then O += P V with V the tile's first R
//   columns. A block takes one token, up to 64 heads and one KV split; its warps come in pairs that
//   share 16 heads and each own half of O's R columns (128 float32 accumulators per lane at
//   R = 512). Each warp of a pair computes S for half of the tile's positions and the pair exchanges
//   row maxima and P through shared memory (0.5-2 % faster than both warps computing the whole S,
//   H100, bench/RESULTS.md). Tiles are double-buffered with cp.async where two fit beside the
//   block's query.
// - The kv_b LoRA is grouped per token instead (all heads of a token share A), in two small kernels
//   around the attention.
// Every kernel waits for its predecessor first and then lets its dependents launch (launch_pdl).
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/mla_attention.cuh"
#include "backends/cuda/kernels/mla_internal.cuh"
#include "backends/cuda_plan/shape_limits.h"
#include "ops/weight_format.h"

namespace moelora::cuda {
namespace {

using mla_internal::aligned16;
using mla_internal::bf;
using mla_internal::seq_pages;

using cuda_plan::kMlaMaxLatent;
using cuda_plan::kMlaMaxLatentWidth;
using cuda_plan::kMlaMaxSplits;

// ---- Absorptions (absorb_kernel): 4 warps, each 16 token rows of a 64-token chunk and NTW
// n-tiles of 8 output columns; K in slices of kAbsorbK staged in shared memory.
constexpr int kAbsorbWarps = 4;
constexpr int kAbsorbThreads = 32 * kAbsorbWarps;
constexpr int kAbsorbRows = 16 * kAbsorbWarps;  // tokens per block (cuda_plan::kMlaAbsorbTokens)
constexpr int kAbsorbK = 128;
constexpr int kAbsorbPitch = kAbsorbK + 8;  // bf16: 68 words per row, 4 mod 32, so the fragment loads miss no bank
static_assert(kAbsorbRows == cuda_plan::kMlaAbsorbTokens, "the plan's token chunk is the kernel's");

// The kv_b LoRA kernels: a block is one token x kLoraHeads heads (2: 64 blocks for DeepSeek-V3's
// 128 heads at one token; with 8, 16 blocks of serial sums took 19 us, ncu on the H200, 2026-12-07).
constexpr int kLoraHeads = 2;
constexpr int kLoraThreads = 128;
constexpr int kLoraMaxRank = cuda_plan::kMaxLoraRank;  // set_lora_slot refuses higher ranks

// The token's kv_b LoRA (rank 0: none). Slots outside the table never occur (the backend checks
// eager steps; graphs only see the slots of placed adapters); they read as "no adapter" rather
// than out of bounds.
struct TokenLora {
  const bf16* a = nullptr;
  const bf16* b = nullptr;
  int rank = 0;
};
__device__ __forceinline__ TokenLora token_lora(const MlaAbsorbedParams& p, int t) {
  TokenLora l;
  if (p.lora_a == nullptr) return l;
  const int s = p.token_slot[t];
  if (s < 0 || s >= p.lora_slots) return l;
  const int r = min(p.lora_rank[s], min(p.lora_rank_stride, kLoraMaxRank));
  if (r <= 0) return l;
  l.a = reinterpret_cast<const bf16*>(p.lora_a[s]);
  l.b = reinterpret_cast<const bf16*>(p.lora_b[s]);
  l.rank = r;
  return l;
}

// The token's cache row: (c, k_pe) of tokens [t_first, t_first + nt) of the pass, token tt by the
// block whose x index is tt mod `stride` (the caller's blocks x = 0 .. stride - 1), 16-byte chunks
// where every row allows them.
__device__ __forceinline__ void write_cache_rows(const MlaAbsorbedParams& p, int t_first, int nt, int x, int stride) {
  const int width = p.R + p.rope;
  const bool vec = p.R % 8 == 0 && p.rope % 8 == 0 && p.ld_latent % 8 == 0 && p.ld_k_pe % 8 == 0 &&
                   aligned16(p.latent) && aligned16(p.k_pe) && aligned16(p.cache);
  for (int tt = x; tt < nt; tt += stride) {
    const int t = t_first + tt;
    bf16* row = p.cache + paged_cache_row(seq_pages(p, t), p.page_size, p.positions[t]) * width;
    const bf16* c = p.latent + static_cast<int64_t>(t) * p.ld_latent;
    const bf16* pe = p.k_pe + static_cast<int64_t>(t) * p.ld_k_pe;
    if (vec) {
      for (int i = 8 * threadIdx.x; i < width; i += 8 * blockDim.x)
        *reinterpret_cast<uint4*>(row + i) = *reinterpret_cast<const uint4*>(i < p.R ? c + i : pe + i - p.R);
    } else {
      for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = i < p.R ? c[i] : pe[i - p.R];
    }
  }
}

// Whether the absorption's A rows can be staged 8 values at a time: q_nope rows (bf16, by cp.async)
// start 16-byte aligned, or the float32 latent rows (the scratch is 256-byte aligned) hold whole
// 8-value groups.
template <bool kOutput>
__device__ __forceinline__ bool a_rows_vectorizable(const MlaAbsorbedParams& p) {
  if constexpr (kOutput)
    return p.R % 8 == 0;
  else
    return p.nope % 8 == 0 && (p.nope + p.rope) % 8 == 0 && p.ld_q % 8 == 0 && aligned16(p.q);
}

// Stages A rows [0, arows) x K values [k0, k0 + kp) of the absorption as bf16 (zeros past the nt
// tokens and past kn values). Each thread has several 16-byte loads in flight: one element per
// thread and iteration left every load's latency exposed (ncu, H100, 2026-12-07).
template <bool kOutput>
__device__ __forceinline__ void stage_a_slice(const MlaAbsorbedParams& p, bf16* As, int t_first, int tt_first, int nt,
                                              int arows, int h, int k0, int kn, int kp, const float* lat, bool vec) {
  if (vec) {
    const int chunks = kp / 8, total = arows * chunks;
    if constexpr (!kOutput) {
      for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const int r = idx / chunks, c = idx % chunks;
        const bool ok = r < nt && c * 8 < kn;
        const bf16* src = p.q + static_cast<int64_t>(t_first + r) * p.ld_q +
                          static_cast<int64_t>(h) * (p.nope + p.rope) + k0 + c * 8;
        cp_async<16>(As + r * kAbsorbPitch + c * 8, ok ? src : p.q, ok);
      }
      cp_async_commit();
    } else {
      constexpr int kBatch = 4;
      for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
        float4 lo[kBatch], hi[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int idx = base + u * blockDim.x, r = idx / chunks, c = idx % chunks;
          lo[u] = hi[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (idx < total && r < nt && c * 8 < kn) {
            const float4* src = reinterpret_cast<const float4*>(
                lat + (static_cast<int64_t>(tt_first + r) * p.heads + h) * p.R + k0 + c * 8);
            lo[u] = src[0];
            hi[u] = src[1];
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int idx = base + u * blockDim.x, r = idx / chunks, c = idx % chunks;
          if (idx < total)
            *reinterpret_cast<uint4*>(As + r * kAbsorbPitch + c * 8) =
                make_uint4(pack_bf16x2(lo[u].x, lo[u].y), pack_bf16x2(lo[u].z, lo[u].w), pack_bf16x2(hi[u].x, hi[u].y),
                           pack_bf16x2(hi[u].z, hi[u].w));
        }
      }
    }
    return;
  }
  for (int idx = threadIdx.x; idx < arows * kp; idx += blockDim.x) {
    const int r = idx / kp, c = idx % kp;
    float v = 0.0f;
    if (r < nt && c < kn) {
      if constexpr (kOutput)
        v = lat[(static_cast<int64_t>(tt_first + r) * p.heads + h) * p.R + k0 + c];
      else
        v = bf(p.q[static_cast<int64_t>(t_first + r) * p.ld_q + static_cast<int64_t>(h) * (p.nope + p.rope) + k0 + c]);
    }
    As[r * kAbsorbPitch + c] = __float2bfloat16_rn(v);
  }
}

// ---- 1 and 6. The absorptions: C[m][n] = sum_k A[m][k] W[n][k] for one head, bf16 operands,
// float32 accumulation.
//   kOutput false (query_absorb): A = q_nope (bf16 rows of q), W = W_UK_h^T [R][nope], C -> the
//                  float32 qc scratch; the (head 0, column chunk 0) blocks also write the cache rows.
//   kOutput true (output_absorb): A = the float32 latent output o (rounded to bf16 here), W = W_UV_h
//                  [v_dim][R], C + B_UV_h u (the kv_b LoRA's expand, float32) -> bf16 out, rounded once.
template <bool kOutput, int NTW>
__global__ void __launch_bounds__(kAbsorbThreads) absorb_kernel(MlaAbsorbedParams p, int t0, int tc, float* lat,
                                                                 const float* ua) {
  extern __shared__ __align__(16) bf16 smem[];
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  constexpr int kCols = 8 * NTW;
  bf16* As = smem;                               // [kAbsorbRows][kAbsorbPitch]
  bf16* Ws = smem + kAbsorbRows * kAbsorbPitch;  // [kCols][kAbsorbPitch]
  const int h = blockIdx.x, n0 = blockIdx.y * kCols, tt0 = blockIdx.z * kAbsorbRows;
  const int nt = min(kAbsorbRows, tc - tt0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int K = kOutput ? p.R : p.nope, N = kOutput ? p.v_dim : p.R;
  const bf16* w = (kOutput ? p.w_uv : p.w_uk_t) + static_cast<int64_t>(h) * N * K;

  if constexpr (!kOutput) {
    // Every token of the pass enters the cache once: token tt of this chunk by the column-chunk-0
    // block of head tt mod heads (one block writing all 64 rows serially took 184 us, ncu, H100).
    if (blockIdx.y == 0) write_cache_rows(p, t0 + tt0, nt, h, gridDim.x);
  }
  const bool warp_rows = warp * 16 < nt;  // warp-uniform: the warp has a token
  float acc[NTW][4];
#pragma unroll
  for (int j = 0; j < NTW; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const bool w_vec = K % 8 == 0;  // W rows start 16-byte aligned (its own allocation, K values per row)
  const bool a_vec = a_rows_vectorizable<kOutput>(p);
  const int arows = min(kAbsorbRows, (nt + 15) / 16 * 16);  // A rows staged: those of warps with a token
  for (int k0 = 0; k0 < K; k0 += kAbsorbK) {
    const int kn = min(kAbsorbK, K - k0), kp = (kn + 15) / 16 * 16;
    __syncthreads();  // the previous slice is consumed
    // W slice: kCols rows x kp values (zeros past N and K).
    if (w_vec) {
      const int chunks = kp / 8;
      for (int idx = tid; idx < kCols * chunks; idx += kAbsorbThreads) {
        const int r = idx / chunks, c = idx % chunks;
        const bool ok = n0 + r < N && c * 8 < kn;
        cp_async<16>(Ws + r * kAbsorbPitch + c * 8, ok ? w + static_cast<int64_t>(n0 + r) * K + k0 + c * 8 : w, ok);
      }
      cp_async_commit();
    } else {
      for (int idx = tid; idx < kCols * kp; idx += kAbsorbThreads) {
        const int r = idx / kp, c = idx % kp;
        Ws[r * kAbsorbPitch + c] = n0 + r < N && c < kn ? w[static_cast<int64_t>(n0 + r) * K + k0 + c] : bf16(0.0f);
      }
    }
    // A slice: the rows of the warps that have a token (zeros past the pass's tokens and K).
    stage_a_slice<kOutput>(p, As, t0 + tt0, tt0, nt, arows, h, k0, kn, kp, lat, a_vec);
    cp_async_wait<0>();
    __syncthreads();
    if (warp_rows) {
      const uint32_t* a32 = reinterpret_cast<const uint32_t*>(As + (warp * 16 + g) * kAbsorbPitch) + q;
      const uint32_t* w32 = reinterpret_cast<const uint32_t*>(Ws + g * kAbsorbPitch) + q;
      for (int ks = 0; ks < kp / 16; ++ks) {
        uint32_t a[4];
        a[0] = a32[ks * 8];
        a[1] = a32[ks * 8 + 8 * kAbsorbPitch / 2];
        a[2] = a32[ks * 8 + 4];
        a[3] = a32[ks * 8 + 4 + 8 * kAbsorbPitch / 2];
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const uint32_t* b = w32 + j * 8 * kAbsorbPitch / 2 + ks * 8;
          mma_bf16_16816(acc[j], a, b[0], b[4]);
        }
      }
    }
  }
  if (!warp_rows) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + g + 8 * half;  // token of the chunk
    if (r >= nt) continue;
    const int tt = tt0 + r;
    if constexpr (!kOutput) {
      float* dst = lat + (static_cast<int64_t>(tt) * p.heads + h) * p.R;
#pragma unroll
      for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = n0 + j * 8 + 2 * q + e;
          if (n < N) dst[n] = acc[j][2 * half + e];
        }
    } else {
      const TokenLora lo = ua ? token_lora(p, t0 + tt) : TokenLora{};
      bf16* dst = p.out + static_cast<int64_t>(t0 + tt) * p.ld_out + static_cast<int64_t>(h) * p.v_dim;
      // B_UV_h u: rows h * F + nope + n of the kv_b LoRA's B. The rank loop is outside 4 n-tiles
      // (8 columns of the thread) so that their loads are in flight together (each column's own
      // loop was a chain of dependent round trips); each column still sums k in order.
      const float* u = lo.rank ? ua + (static_cast<int64_t>(tt) * p.heads + h) * p.lora_rank_stride : nullptr;
      const bf16* b = lo.rank ? lo.b + (static_cast<int64_t>(h) * (p.nope + p.v_dim) + p.nope + n0 + 2 * q) * lo.rank
                              : nullptr;
      constexpr int kJ = NTW < 4 ? NTW : 4;
#pragma unroll
      for (int j0 = 0; j0 < NTW; j0 += kJ) {
        float lora[kJ][2];
#pragma unroll
        for (int j = 0; j < kJ; ++j) lora[j][0] = lora[j][1] = 0.0f;
        if (u) {
#pragma unroll 4
          for (int k = 0; k < lo.rank; ++k) {
            const float uk = u[k];
#pragma unroll
            for (int j = 0; j < kJ; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e)
                if (n0 + (j0 + j) * 8 + 2 * q + e < N)
                  lora[j][e] += bf(b[static_cast<int64_t>((j0 + j) * 8 + e) * lo.rank + k]) * uk;
          }
        }
#pragma unroll
        for (int j = 0; j < kJ; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = n0 + (j0 + j) * 8 + 2 * q + e;
            if (n < N) dst[n] = __float2bfloat16_rn(acc[j0 + j][2 * half + e] + lora[j][e]);
          }
      }
    }
  }
}

// ---- 2. qc += A^T (B_UK_h^T q_nope_h) for the token's adapter: u = B_UK_h^T q_nope_h per head
// (rank values), then A^T u with each row of A read once for the block's heads. For u, the two
// warps of a head take alternate 32-value runs of nope, each lane reads its rows of B (r values
// each, 16 at a time) and the warps' sums meet in shared memory in a fixed order; a warp per
// (head, rank) pair with one load after another was 8 round trips per warp.
constexpr int kLoraRankChunk = 16;
constexpr int kLoraWarpsPerHead = kLoraThreads / 32 / kLoraHeads;
static_assert(kLoraWarpsPerHead * kLoraHeads * 32 == kLoraThreads, "whole warps per head");
__global__ void __launch_bounds__(kLoraThreads) lora_query_kernel(MlaAbsorbedParams p, int t0, float* lat) {
  __shared__ float part[kLoraHeads][kLoraWarpsPerHead][kLoraMaxRank];
  pdl_wait();
  pdl_trigger();
  const int tl = blockIdx.x, t = t0 + tl;
  const TokenLora lo = token_lora(p, t);
  if (lo.rank == 0) return;
  const int r = lo.rank, h0 = blockIdx.y * kLoraHeads, nh = min(kLoraHeads, p.heads - h0);
  const int F = p.nope + p.v_dim, qh = p.nope + p.rope;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hc = warp / kLoraWarpsPerHead, wh = warp % kLoraWarpsPerHead, h = h0 + hc;
  if (hc < nh) {
    const bf16* qn = p.q + static_cast<int64_t>(t) * p.ld_q + static_cast<int64_t>(h) * qh;
    const bf16* bh = lo.b + static_cast<int64_t>(h) * F * r;  // B rows h*F + d, r values each
    for (int kc = 0; kc < r; kc += kLoraRankChunk) {
      float acc[kLoraRankChunk];
#pragma unroll
      for (int k = 0; k < kLoraRankChunk; ++k) acc[k] = 0.0f;
#pragma unroll 2
      for (int d = 32 * wh + lane; d < p.nope; d += 32 * kLoraWarpsPerHead) {
        const float x = bf(qn[d]);
        const bf16* brow = bh + static_cast<int64_t>(d) * r + kc;
#pragma unroll
        for (int k = 0; k < kLoraRankChunk; ++k)
          if (kc + k < r) acc[k] += x * bf(brow[k]);
      }
#pragma unroll
      for (int k = 0; k < kLoraRankChunk; ++k) {
        const float v = warp_sum(acc[k]);
        if (lane == 0 && kc + k < r) part[hc][wh][kc + k] = v;
      }
    }
  } else {  // a head past the model's (an odd last group): zeros, read below but never stored
    for (int k = lane; k < r; k += 32) part[hc][wh][k] = 0.0f;
  }
  __syncthreads();
  constexpr int kI = 4;  // values of a row of A per thread and round, their loads in flight together
  for (int i0 = threadIdx.x; i0 < p.R; i0 += kI * kLoraThreads) {
    float acc[kI][kLoraHeads];
#pragma unroll
    for (int ii = 0; ii < kI; ++ii)
#pragma unroll
      for (int c = 0; c < kLoraHeads; ++c) acc[ii][c] = 0.0f;
#pragma unroll 4
    for (int k = 0; k < r; ++k) {
      float uk[kLoraHeads];
#pragma unroll
      for (int c = 0; c < kLoraHeads; ++c) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kLoraWarpsPerHead; ++w) s += part[c][w][k];
        uk[c] = s;
      }
      const bf16* arow = lo.a + static_cast<int64_t>(k) * p.R;
#pragma unroll
      for (int ii = 0; ii < kI; ++ii) {
        const int i = i0 + ii * kLoraThreads;
        const float a = i < p.R ? bf(arow[i]) : 0.0f;
#pragma unroll
        for (int c = 0; c < kLoraHeads; ++c) acc[ii][c] += uk[c] * a;
      }
    }
#pragma unroll
    for (int ii = 0; ii < kI; ++ii) {
      const int i = i0 + ii * kLoraThreads;
      if (i >= p.R) continue;
      float* dst = lat + (static_cast<int64_t>(tl) * p.heads + h0) * p.R + i;
#pragma unroll
      for (int c = 0; c < kLoraHeads; ++c)
        if (c < nh) dst[static_cast<int64_t>(c) * p.R] += acc[ii][c];
    }
  }
}

// ---- 5. u = A o_h per head of the token's adapter (the output-side LoRA shrink); a warp per rank
// row k reads A[k] along R once for the block's heads.
__global__ void __launch_bounds__(kLoraThreads) lora_output_shrink_kernel(MlaAbsorbedParams p, int t0,
                                                                            const float* lat, float* ua) {
  extern __shared__ float o[];  // [kLoraHeads][R]
  pdl_wait();
  pdl_trigger();
  const int tl = blockIdx.x, t = t0 + tl;
  const TokenLora lo = token_lora(p, t);
  if (lo.rank == 0) return;
  const int h0 = blockIdx.y * kLoraHeads, nh = min(kLoraHeads, p.heads - h0);
  const float* src = lat + (static_cast<int64_t>(tl) * p.heads + h0) * p.R;
  for (int idx = threadIdx.x; idx < kLoraHeads * p.R; idx += kLoraThreads)
    o[idx] = idx < nh * p.R ? src[idx] : 0.0f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int k = warp; k < lo.rank; k += kLoraThreads / 32) {
    const bf16* arow = lo.a + static_cast<int64_t>(k) * p.R;
    float acc[kLoraHeads];
#pragma unroll
    for (int hc = 0; hc < kLoraHeads; ++hc) acc[hc] = 0.0f;
#pragma unroll 16  // R = 512: a lane's 16 loads of the row in flight together
    for (int i = lane; i < p.R; i += 32) {
      const float a = bf(arow[i]);
#pragma unroll
      for (int hc = 0; hc < kLoraHeads; ++hc) acc[hc] += a * o[hc * p.R + i];
    }
#pragma unroll
    for (int hc = 0; hc < kLoraHeads; ++hc) acc[hc] = warp_sum(acc[hc]);
    if (lane == 0)
      for (int hc = 0; hc < nh; ++hc)
        ua[(static_cast<int64_t>(tl) * p.heads + h0 + hc) * p.lora_rank_stride + k] = acc[hc];
  }
}

// ---- kv_b -> the kernels' bf16 layouts.
__global__ void prepare_weights_kernel(MlaWeightPrep p) {
  const int F = p.nope + p.v_dim;
  const int64_t n = static_cast<int64_t>(p.heads) * F * p.R;
  const int col_blocks = (p.R + p.block_in - 1) / p.block_in;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(idx / p.R), col = static_cast<int>(idx % p.R);
    float w;
    if (p.fp8) {
      __nv_fp8_e4m3 code;
      code.__x = static_cast<const uint8_t*>(p.w)[idx];
      const int rb = fp8_scale_row_block(row, p.block_out, p.split_rows);
      w = static_cast<float>(code) * p.scale_inv[static_cast<int64_t>(rb) * col_blocks + col / p.block_in];
    } else {
      w = bf(static_cast<const bf16*>(p.w)[idx]);
    }
    const int h = row / F, d = row % F;
    if (d < p.nope)
      p.w_uk_t[(static_cast<int64_t>(h) * p.R + col) * p.nope + d] = __float2bfloat16_rn(w);
    else
      p.w_uv[(static_cast<int64_t>(h) * p.v_dim + (d - p.nope)) * p.R + col] = __float2bfloat16_rn(w);
  }
}

template <bool kOutput, int NTW>
constexpr size_t absorb_smem_bytes() {
  return sizeof(bf16) * (kAbsorbRows + 8 * NTW) * kAbsorbPitch;
}

template <bool kOutput, int NTW>
void launch_absorb(const MlaAbsorbedParams& p, int t0, int tc, float* lat, const float* ua, cudaStream_t stream) {
  const int N = kOutput ? p.v_dim : p.R;
  const dim3 grid(p.heads, ceil_div(N, 8 * NTW), ceil_div(tc, kAbsorbRows));
  launch_pdl(absorb_kernel<kOutput, NTW>, grid, dim3(kAbsorbThreads), absorb_smem_bytes<kOutput, NTW>(), stream, p, t0,
             tc, lat, ua);
  MOELORA_CUDA_CHECK_LAUNCH();
}

template <bool kOutput, int NTW>
void absorb_prepare() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(absorb_kernel<kOutput, NTW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(absorb_smem_bytes<kOutput, NTW>())));
}

template <bool kOutput>
void launch_absorb_cols(const MlaAbsorbedParams& p, int cols, int t0, int tc, float* lat, const float* ua,
                        cudaStream_t stream) {
  if (cols == 32)
    launch_absorb<kOutput, 4>(p, t0, tc, lat, ua, stream);
  else
    launch_absorb<kOutput, 16>(p, t0, tc, lat, ua, stream);
}

}  // namespace

void launch_mla_absorbed(const MlaAbsorbedParams& p, const cuda_plan::MlaPlan& plan, void* scratch,
                         size_t scratch_bytes, cudaStream_t stream) {
  MOELORA_CHECK_MSG(p.T >= 0 && p.heads >= 1 && p.nope >= 0 && p.rope >= 0 && p.v_dim >= 1 && p.R >= 1 &&
                        p.page_size >= 1,
                    "absorbed MLA: T {}, heads {}, nope {}, rope {}, v {}, R {}, page size {}", p.T, p.heads, p.nope,
                    p.rope, p.v_dim, p.R, p.page_size);
  MOELORA_CHECK_MSG(p.R <= kMlaMaxLatent && p.R + p.rope <= kMlaMaxLatentWidth,
                    "absorbed MLA: cache rows of {} + {} values, the kernels take a latent of at most {} and rows of "
                    "at most {}",
                    p.R, p.rope, kMlaMaxLatent, kMlaMaxLatentWidth);
  MOELORA_CHECK_MSG(p.lora_a == nullptr || (p.lora_rank_stride >= 1 && p.lora_rank_stride <= kLoraMaxRank),
                    "absorbed MLA: LoRA rank stride {} outside 1..{}", p.lora_rank_stride, kLoraMaxRank);
  MOELORA_CHECK_MSG(plan.splits >= 1 && plan.splits <= kMlaMaxSplits && plan.chunk_tokens >= 1 && scratch_bytes >= plan.scratch_bytes() &&
                        (plan.query_cols == 32 || plan.query_cols == 128) &&
                        (plan.output_cols == 32 || plan.output_cols == 128),
                    "absorbed MLA plan: {} splits, {} tokens per pass, {} of {} scratch bytes, "
                    "absorption columns {} / {}",
                    plan.splits, plan.chunk_tokens, scratch_bytes, plan.scratch_bytes(),
                    plan.query_cols, plan.output_cols);
  if (p.T == 0) return;
  char* base = static_cast<char*>(scratch);
  float* lat = reinterpret_cast<float*>(base);
  float* part_o = reinterpret_cast<float*>(base + plan.latent_bytes);
  float* part_stats = reinterpret_cast<float*>(base + plan.latent_bytes + plan.partial_bytes);
  float* ua = p.lora_a ? reinterpret_cast<float*>(base + plan.latent_bytes + plan.partial_bytes + plan.stats_bytes)
                       : nullptr;
  const int lora_groups = ceil_div(p.heads, kLoraHeads);
  for (int t0 = 0; t0 < p.T; t0 += plan.chunk_tokens) {
    const int tc = std::min(plan.chunk_tokens, p.T - t0);
    launch_absorb_cols<false>(p, plan.query_cols, t0, tc, lat, nullptr, stream);
    if (ua) {
      launch_pdl(lora_query_kernel, dim3(tc, lora_groups), dim3(kLoraThreads), 0, stream, p, t0, lat);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    mla_internal::launch_latent_attention(p, t0, tc, plan.splits, lat, part_o, part_stats, stream);
    if (ua) {
      launch_pdl(lora_output_shrink_kernel, dim3(tc, lora_groups), dim3(kLoraThreads), sizeof(float) * kLoraHeads * p.R,
                 stream, p, t0, static_cast<const float*>(lat), ua);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    launch_absorb_cols<true>(p, plan.output_cols, t0, tc, lat, ua, stream);
  }
}

void mla_prepare() {
  static bool done = false;  // only the engine thread launches kernels; idempotent
  if (done) return;
  mla_internal::latent_attention_prepare();
  absorb_prepare<false, 4>();
  absorb_prepare<false, 16>();
  absorb_prepare<true, 4>();
  absorb_prepare<true, 16>();
  done = true;
}

void launch_mla_prepare_weights(const MlaWeightPrep& p, cudaStream_t stream) {
  MOELORA_CHECK_MSG(p.heads >= 1 && p.nope >= 0 && p.v_dim >= 1 && p.R >= 1 && (!p.fp8 || p.scale_inv != nullptr),
                    "absorbed MLA weights: heads {}, nope {}, v {}, R {}", p.heads, p.nope, p.v_dim, p.R);
  const int64_t n = static_cast<int64_t>(p.heads) * (p.nope + p.v_dim) * p.R;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div64(n, 256), 4096));
  prepare_weights_kernel<<<blocks, 256, 0, stream>>>(p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
