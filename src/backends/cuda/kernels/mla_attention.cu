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
#include "backends/cuda_plan/shape_limits.h"
#include "ops/weight_format.h"

namespace moelora::cuda {
namespace {

using cuda_plan::kMlaMaxLatent;
using cuda_plan::kMlaMaxLatentWidth;
using cuda_plan::kMlaMaxSplits;
using cuda_plan::kMlaTilePositions;

constexpr float kLog2e = 1.4426950408889634f;

// ---- Absorptions (absorb_kernel): 4 warps, each 16 token rows of a 64-token chunk and NTW
// n-tiles of 8 output columns; K in slices of kAbsorbK staged in shared memory.
constexpr int kAbsorbWarps = 4;
constexpr int kAbsorbThreads = 32 * kAbsorbWarps;
constexpr int kAbsorbRows = 16 * kAbsorbWarps;  // tokens per block (cuda_plan::kMlaAbsorbTokens)
constexpr int kAbsorbK = 128;
constexpr int kAbsorbPitch = kAbsorbK + 8;  // bf16: 68 words per row, 4 mod 32, so the fragment loads miss no bank
static_assert(kAbsorbRows == cuda_plan::kMlaAbsorbTokens, "the plan's token chunk is the kernel's");

// ---- Latent attention: warp pairs of 16 heads, 64 positions per tile.
constexpr int kTile = kMlaTilePositions;
constexpr int kMaxRowGroups = cuda_plan::kMlaMaxHeadsPerBlock / 16;
constexpr int kMaxHalfTiles = kMlaMaxLatent / 2 / 8;  // n-tiles of 8 columns in half of O
static_assert(kTile == 64, "the S fragments below cover 8 n-tiles of 8 positions");
static_assert(cuda_plan::kMlaMaxHeadsPerBlock % 16 == 0, "row groups of 16 heads");

// The kv_b LoRA kernels: a block is one token x kLoraHeads heads (2: 64 blocks for DeepSeek-V3's
// 128 heads at one token; with 8, 16 blocks of serial sums took 19 us, ncu on the H200, 2026-12-07).
constexpr int kLoraHeads = 2;
constexpr int kLoraThreads = 128;
constexpr int kLoraMaxRank = cuda_plan::kMaxLoraRank;  // set_lora_slot refuses higher ranks

__device__ __forceinline__ float bf(const bf16 v) { return __bfloat162float(v); }

__device__ __forceinline__ const int32_t* seq_pages(const MlaAbsorbedParams& p, int t) {
  return p.page_indices + p.page_indptr[p.token_seq[t]];
}

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

__device__ __forceinline__ bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

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

// ---- 3. Latent attention on tensor cores.
// Shared memory: the block's query Q [heads of the block][cols] (qc rounded to bf16, then q_pe,
// zeros past R + rope and for heads past the model's), `stages` tiles of kTile cache rows
// [kTile][cols] (zeros past the row's R + rope values and for rows past the split), then the warp
// pairs' exchange area. cols is a multiple of 64 values, so a row is whole groups of eight 16-byte
// chunks, and chunk c of row r is stored at c ^ (r % 8): the 32-bit fragment loads of 8 rows and
// ldmatrix's 8 row addresses then fall in distinct banks without padding (which would not fit
// DeepSeek-V3's query, two tiles and the exchange area in 227 KiB).
struct LatentShape {
  int cols;        // MMA width of a row: R + rope and 2 * half_cols, rounded up to 64
  int half_cols;   // O columns per warp of a pair: ceil(R / 2) rounded to 16
  int row_groups;  // 16-head groups per block (warps = 2 x row_groups)
  int stages;      // tiles in flight (2 where they fit beside the query, else 1)
};

// Per row group: the pair's row maxima and softmax sums (2 warps x 16 rows) and P as A fragments
// (2 warps x 2 k-steps x 32 lanes x 4 words).
struct PairExchange {
  float max[2][16];
  float sum[2][16];
  uint4 p[2][2][32];
};
constexpr int kExchangeBytes = kMaxRowGroups * static_cast<int>(sizeof(PairExchange));

inline LatentShape latent_shape(int heads, int R, int rope, int max_smem) {
  LatentShape s;
  s.half_cols = ((R + 1) / 2 + 15) / 16 * 16;
  s.cols = (max(R + rope, 2 * s.half_cols) + 63) / 64 * 64;
  s.row_groups = cuda_plan::mla_heads_per_block(heads) / 16;  // the plan's head groups
  const int q_bytes = 16 * s.row_groups * s.cols * 2, tile_bytes = kTile * s.cols * 2;
  s.stages = q_bytes + 2 * tile_bytes + kExchangeBytes <= max_smem ? 2 : 1;
  return s;
}
inline int latent_smem_bytes(const LatentShape& s) {
  return (16 * s.row_groups + s.stages * kTile) * s.cols * 2 + kExchangeBytes;
}

// Element offset of (row, column) in a swizzled [rows][cols] area.
__device__ __forceinline__ int swz(int row, int col, int cols) {
  return row * cols + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// Copies cache rows [p0, p0 + cnt) of the token's sequence into a tile (cp.async where rows are
// 16-byte aligned; the caller commits), zeros elsewhere.
__device__ __forceinline__ void stage_tile(const MlaAbsorbedParams& p, const int32_t* pages, int p0, int cnt,
                                           const LatentShape& s, bf16* tile) {
  const int width = p.R + p.rope;
  if (width % 8 == 0) {
    const int chunks = s.cols / 8;
    for (int idx = threadIdx.x; idx < kTile * chunks; idx += blockDim.x) {
      const int r = idx / chunks, c = idx % chunks;
      const bool ok = r < cnt && c * 8 < width;
      const bf16* src = ok ? p.cache + paged_cache_row(pages, p.page_size, p0 + r) * width + c * 8 : p.cache;
      cp_async<16>(tile + swz(r, 8 * c, s.cols), src, ok);
    }
  } else {
    for (int idx = threadIdx.x; idx < kTile * s.cols; idx += blockDim.x) {
      const int r = idx / s.cols, c = idx % s.cols;
      tile[swz(r, c, s.cols)] =
          r < cnt && c < width ? p.cache[paged_cache_row(pages, p.page_size, p0 + r) * width + c] : bf16(0.0f);
    }
  }
}

// The block's query in shared memory: qc (the float32 scratch) rounded to bf16, then q_pe as it
// is, zeros past R + rope and for heads the model does not have; one swizzle chunk (8 values) per
// item and several items' loads in flight per thread where rows allow 16-byte loads (element by
// element, the staging's exposed load latency was most of the kernel at one token, ncu, H100).
__device__ __forceinline__ void stage_query(const MlaAbsorbedParams& p, const LatentShape& sh, int t, int tl,
                                            int h_block, int hb, const float* lat, bf16* Qs) {
  const int qh = p.nope + p.rope;
  const bool vec = p.R % 8 == 0 && p.rope % 8 == 0 && p.nope % 8 == 0 && p.ld_q % 8 == 0 && aligned16(p.q);
  if (!vec) {
    for (int idx = threadIdx.x; idx < hb * sh.cols; idx += blockDim.x) {
      const int hl = idx / sh.cols, c = idx % sh.cols, h = h_block + hl;
      float v = 0.0f;
      if (h < p.heads) {
        if (c < p.R)
          v = lat[(static_cast<int64_t>(tl) * p.heads + h) * p.R + c];
        else if (c < p.R + p.rope)
          v = bf(p.q[static_cast<int64_t>(t) * p.ld_q + static_cast<int64_t>(h) * qh + p.nope + c - p.R]);
      }
      Qs[swz(hl, c, sh.cols)] = __float2bfloat16_rn(v);
    }
    return;
  }
  constexpr int kBatch = 4;
  const int chunks = sh.cols / 8, total = hb * chunks;
  for (int base = threadIdx.x; base < total; base += kBatch * blockDim.x) {
    float4 lo[kBatch], hi[kBatch];
    uint4 pe[kBatch];
    int kind[kBatch];  // 0: zeros, 1: qc (lo, hi), 2: q_pe
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * blockDim.x, hl = idx / chunks, c = idx % chunks * 8, h = h_block + hl;
      kind[u] = 0;
      lo[u] = hi[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      pe[u] = make_uint4(0, 0, 0, 0);
      if (idx >= total || h >= p.heads) continue;
      if (c < p.R) {
        const float4* src = reinterpret_cast<const float4*>(lat + (static_cast<int64_t>(tl) * p.heads + h) * p.R + c);
        lo[u] = src[0];
        hi[u] = src[1];
        kind[u] = 1;
      } else if (c < p.R + p.rope) {
        pe[u] = *reinterpret_cast<const uint4*>(p.q + static_cast<int64_t>(t) * p.ld_q + static_cast<int64_t>(h) * qh +
                                                p.nope + c - p.R);
        kind[u] = 2;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * blockDim.x, hl = idx / chunks, c = idx % chunks * 8;
      if (idx >= total) continue;
      const uint4 v = kind[u] == 1 ? make_uint4(pack_bf16x2(lo[u].x, lo[u].y), pack_bf16x2(lo[u].z, lo[u].w),
                                                pack_bf16x2(hi[u].x, hi[u].y), pack_bf16x2(hi[u].z, hi[u].w))
                                   : pe[u];
      *reinterpret_cast<uint4*>(Qs + swz(hl, c, sh.cols)) = v;
    }
  }
}

__device__ __forceinline__ void pair_sync(int rg) {  // the two warps of row group rg
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg) : "memory");
}

// Block (token, group of 16 x row_groups heads, split). Warp w: heads 16 (w / 2) .. + 15 of the
// block; it computes S for positions [32 (w % 2), + 32) of each tile and O for columns
// [(w % 2) half_cols, + half_cols), exchanging row maxima and P with its pair (the other w % 2).
__global__ void __launch_bounds__(64 * kMaxRowGroups, 1)
    latent_attention_kernel(MlaAbsorbedParams p, LatentShape sh, int t0, int splits, float* lat, float* part_o,
                            float* part_stats) {
  extern __shared__ __align__(16) bf16 smem[];
  pdl_wait();
  pdl_trigger();
  const int tl = blockIdx.x, t = t0 + tl;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int rg = warp / 2, ch = warp % 2;
  const int hb = 16 * sh.row_groups, h_block = blockIdx.y * hb;
  const int n = p.positions[t] + 1;
  const cuda_plan::MlaTokenSplit ts = cuda_plan::mla_token_split(n, splits);
  if (static_cast<int>(blockIdx.z) >= ts.count) return;  // the whole block: the token uses fewer splits
  const int begin = blockIdx.z * ts.chunk, end = min(n, begin + ts.chunk);
  const int32_t* pages = seq_pages(p, t);
  bf16* Qs = smem;
  bf16* tiles = smem + hb * sh.cols;
  PairExchange& xc = reinterpret_cast<PairExchange*>(tiles + sh.stages * kTile * sh.cols)[rg];
  const int ntiles = (end - begin + kTile - 1) / kTile;

  stage_tile(p, pages, begin, min(kTile, end - begin), sh, tiles);
  cp_async_commit();
  stage_query(p, sh, t, tl, h_block, hb, lat, Qs);

  const float qs = p.scale * kLog2e;  // scores in the exp2 domain
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[kMaxHalfTiles][4];
#pragma unroll
  for (int j = 0; j < kMaxHalfTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int rw = sh.cols / 2;  // words per row
  // Rows 16 rg + g (+ 8) of Q and 32 ch + 8 j + g of a tile are all g mod 8: one swizzle per lane.
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(Qs) + (16 * rg + g) * rw + q;
  const int half_tiles = sh.half_cols / 8;
  // ldmatrix.trans row of this lane for P V: matrix L / 8 of a 16 x 16 block is (positions
  // 8 (L / 8 % 2) .., columns 8 (L / 16) ..), its row L % 8 (so its row mod 8 is lane % 8).
  const int v_row = (lane / 8 % 2) * 8 + lane % 8, v_chunk = ch * sh.half_cols / 8 + lane / 16;

  for (int i = 0; i < ntiles; ++i) {
    const int p0 = begin + i * kTile, cnt = min(kTile, end - p0);
    if (sh.stages == 2) {
      if (i + 1 < ntiles)
        stage_tile(p, pages, p0 + kTile, min(kTile, end - p0 - kTile), sh, tiles + ((i + 1) % 2) * kTile * sh.cols);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // the tile (and, the first time, the query) is in shared memory
    const bf16* tile = tiles + (sh.stages == 2 ? i % 2 : 0) * kTile * sh.cols;
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(tile) + (32 * ch + g) * rw + q;

    // S = Q K^T: 16 heads x this warp's 32 positions.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll 2
    for (int ks = 0; ks < sh.cols / 16; ++ks) {
      const int c0 = ((2 * ks) ^ g) * 4, c1 = ((2 * ks + 1) ^ g) * 4;  // swizzled words of chunks 2ks, 2ks+1
      uint32_t a[4];
      a[0] = q32[c0];
      a[1] = q32[c0 + 8 * rw];
      a[2] = q32[c1];
      a[3] = q32[c1 + 8 * rw];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t* b = k32 + j * 8 * rw;
        mma_bf16_16816(s[j], a, b[c0], b[c1]);
      }
    }
    // Online softmax of rows g (s[.][0..1]) and g + 8 (s[.][2..3]); positions past the split
    // masked; the row maxima over both halves of the tile through the exchange area.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 32 * ch + j * 8 + 2 * q + (e & 1);
        s[j][e] = col < cnt ? s[j][e] * qs : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (q == 0) xc.max[ch][g] = mx[0], xc.max[ch][g + 8] = mx[1];
    pair_sync(rg);
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mn = fmaxf(m[r], fmaxf(mx[r], xc.max[1 - ch][g + 8 * r]));  // finite: position p0 is inside
      alpha[r] = exp2f(m[r] - mn);  // 0 on the first tile
      m[r] = mn;
      l[r] *= alpha[r];
    }
    uint32_t pa[4][4];  // P as the A operand of the tile's 4 k-steps of 16 positions
    {
      uint32_t mine[2][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2f(s[j][e] - m[e / 2]);
          l[e / 2] += s[j][e];
        }
        mine[j / 2][(j % 2) * 2] = pack_bf16x2(s[j][0], s[j][1]);
        mine[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[j][2], s[j][3]);
      }
#pragma unroll
      for (int kl = 0; kl < 2; ++kl) xc.p[ch][kl][lane] = make_uint4(mine[kl][0], mine[kl][1], mine[kl][2], mine[kl][3]);
      pair_sync(rg);
#pragma unroll
      for (int kl = 0; kl < 2; ++kl) {
        const uint4 other = xc.p[1 - ch][kl][lane];
        const uint32_t oth[4] = {other.x, other.y, other.z, other.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          pa[kl][w] = ch == 0 ? mine[kl][w] : oth[w];  // k-steps 0, 1: positions 0..31 (warp 0 of the pair)
          pa[2 + kl][w] = ch == 0 ? oth[w] : mine[kl][w];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxHalfTiles; ++j) {
      o[j][0] *= alpha[0], o[j][1] *= alpha[0];
      o[j][2] *= alpha[1], o[j][3] *= alpha[1];
    }
    // O += P V over this warp's columns.
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const int row = kk * 16 + v_row;
      const bf16* vrow = tile + row * sh.cols;
#pragma unroll
      for (int j2 = 0; j2 < kMaxHalfTiles / 2; ++j2) {
        if (2 * j2 >= half_tiles) break;
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_addr(vrow + (((v_chunk + 2 * j2) ^ (lane & 7)) << 3)));
        mma_bf16_16816(o[2 * j2], pa[kk], b[0], b[1]);
        mma_bf16_16816(o[2 * j2 + 1], pa[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with the tile and the exchange area before they are refilled
    if (sh.stages == 1 && i + 1 < ntiles) {
      stage_tile(p, pages, p0 + kTile, min(kTile, end - p0 - kTile), sh, tiles);
      cp_async_commit();
    }
  }
  // Row sums: this warp's positions, then its pair's (both scaled by the same maxima).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  if (q == 0) xc.sum[ch][g] = l[0], xc.sum[ch][g + 8] = l[1];
  pair_sync(rg);
  l[0] += xc.sum[1 - ch][g];
  l[1] += xc.sum[1 - ch][g + 8];
  // One split: the normalised output replaces qc (only this block ever reads these qc rows, and
  // it staged them before its first tile). Several: the unnormalised partial and its (max, sum).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h_block + 16 * rg + g + 8 * r;
    if (h >= p.heads) continue;
    const int64_t row = static_cast<int64_t>(tl) * p.heads + h;
    float* dst;
    float norm = 1.0f;
    if (splits == 1) {
      dst = lat + row * p.R;
      norm = 1.0f / l[r];
    } else {
      const int64_t ps = row * splits + blockIdx.z;
      dst = part_o + ps * p.R;
      if (ch == 0 && q == 0) part_stats[2 * ps] = m[r], part_stats[2 * ps + 1] = l[r];
    }
#pragma unroll
    for (int j = 0; j < kMaxHalfTiles; ++j) {
      if (j >= half_tiles) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = ch * sh.half_cols + j * 8 + 2 * q + e;
        if (col < p.R) dst[col] = o[j][2 * r + e] * norm;
      }
    }
  }
}

// ---- 4. Merge of the KV splits of each (token, head): o = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
// over the splits that hold positions of the token (the others never ran).
__global__ void __launch_bounds__(128) merge_splits_kernel(MlaAbsorbedParams p, int t0, int splits, float* lat,
                                                             const float* part_o, const float* part_stats) {
  __shared__ float weight[kMlaMaxSplits];
  pdl_wait();
  pdl_trigger();
  const int64_t row = blockIdx.x;  // token-in-pass * heads + head
  const int t = t0 + static_cast<int>(row / p.heads);
  const int used = cuda_plan::mla_token_split(p.positions[t] + 1, splits).count;
  const float* stats = part_stats + row * splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < used; ++s) mx = fmaxf(mx, stats[2 * s]);
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int s = 0; s < used; ++s) total += exp2f(stats[2 * s] - mx) * stats[2 * s + 1];
    for (int s = 0; s < used; ++s) weight[s] = exp2f(stats[2 * s] - mx) / total;
  }
  __syncthreads();
  const float* po = part_o + row * splits * p.R;
  for (int i = threadIdx.x; i < p.R; i += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < used; ++s) o += weight[s] * po[static_cast<int64_t>(s) * p.R + i];
    lat[row * p.R + i] = o;
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

int max_dynamic_smem() {
  static const int bytes = [] {
    int dev = 0, v = 0;
    MOELORA_CUDA_CHECK(cudaGetDevice(&dev));
    MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return v;
  }();
  return bytes;
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
  const LatentShape sh = latent_shape(p.heads, p.R, p.rope, max_dynamic_smem());
  const int attn_smem = latent_smem_bytes(sh);
  MOELORA_CHECK_MSG(attn_smem <= max_dynamic_smem(), "absorbed MLA: {} bytes of shared memory, the GPU has {}",
                    attn_smem, max_dynamic_smem());
  const int head_groups = ceil_div(p.heads, 16 * sh.row_groups);
  const int lora_groups = ceil_div(p.heads, kLoraHeads);
  for (int t0 = 0; t0 < p.T; t0 += plan.chunk_tokens) {
    const int tc = std::min(plan.chunk_tokens, p.T - t0);
    launch_absorb_cols<false>(p, plan.query_cols, t0, tc, lat, nullptr, stream);
    if (ua) {
      launch_pdl(lora_query_kernel, dim3(tc, lora_groups), dim3(kLoraThreads), 0, stream, p, t0, lat);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    launch_pdl(latent_attention_kernel, dim3(tc, head_groups, plan.splits), dim3(64 * sh.row_groups),
               static_cast<size_t>(attn_smem), stream, p, sh, t0, plan.splits, lat, part_o, part_stats);
    MOELORA_CUDA_CHECK_LAUNCH();
    if (plan.splits > 1) {
      launch_pdl(merge_splits_kernel, dim3(tc * p.heads), dim3(128), 0, stream, p, t0, plan.splits, lat,
                 static_cast<const float*>(part_o), static_cast<const float*>(part_stats));
      MOELORA_CUDA_CHECK_LAUNCH();
    }
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
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(latent_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          max_dynamic_smem()));
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
