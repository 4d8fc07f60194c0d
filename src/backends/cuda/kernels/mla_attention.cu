// DeepSeek MLA, absorbed form (see mla_attention.cuh for the math and the kernel sequence).
//
// Why this shape of kernels: the two absorptions are, per head, GEMMs over the step's tokens
// (qc = q_nope W_UK_h, out = o W_UV_h^T), so their blocks take one head and 32 tokens and each
// weight element is read once per 32 tokens; the attention is MQA with one 576-wide "KV head"
// (the latent row, shared by every query head), so its blocks take one token and 8 heads and stage
// each cache row once in shared memory for all 8 warps. The kv_b LoRA is grouped per token instead
// (all heads of a token share A), in two small kernels around the attention.
//
// Where the time goes (f32 FMAs on CUDA cores, correctness first): per token the absorptions cost
// heads x R x (nope + v_dim) FMAs and read W_UK / W_UV once per 32 tokens; the latent attention costs
// heads x positions x (2R + rope) FMAs, 4x the absorptions at DeepSeek-V3's shapes and 512 positions
// and growing with the context. It is the first candidate for bf16 MMA (qc then rounded to bf16 as a
// query, as the attention kernel rounds P).
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

using cuda_plan::kMlaHeadsPerBlock;
using cuda_plan::kMlaMaxLatentWidth;
using cuda_plan::kMlaMaxSplits;
using cuda_plan::kMlaTilePositions;

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// The two absorption GEMMs: a block is one head x kAbsorbTokens tokens; each thread owns one output
// column and keeps kAbsorbTokens float32 sums in registers; the token-side operand is staged in
// shared memory kStageDepth rows at a time, transposed so that a float4 read gives 4 tokens.
constexpr int kAbsorbTokens = 32;
constexpr int kAbsorbThreads = 128;
constexpr int kStageDepth = 64;
constexpr int kStagePitch = kAbsorbTokens + 4;  // floats: keeps float4 alignment, spreads the stores' banks

// The latent attention: one warp per head of the block, kTile cache rows per shared-memory tile.
constexpr int kAttnWarps = kMlaHeadsPerBlock;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kTile = kMlaTilePositions;
constexpr int kMaxWords = kMlaMaxLatentWidth / 64;  // bf16 pairs per lane of one padded row
static_assert(kTile == 32, "the score reduce-scatter gives lane j the score of row j");
static_assert(kMlaMaxLatentWidth % 64 == 0, "rows are padded to 64-value multiples");
static_assert(kTile * kMlaMaxLatentWidth * 2 <= 48 * 1024, "a tile fits the default dynamic shared memory");

// The kv_b LoRA kernels: a block is one token x kLoraHeads heads.
constexpr int kLoraHeads = 8;
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

// The absorptions' inner loop, shared by both: acc[tt] += sum over the n staged depth rows d of
// stage[d][tt] * w[d * w_stride] (one weight column; a float4 of the stage gives 4 tokens).
__device__ __forceinline__ void fma_staged(const float (&stage)[kStageDepth][kStagePitch], const bf16* w,
                                           int64_t w_stride, int n, float (&acc)[kAbsorbTokens]) {
#pragma unroll 4
  for (int d = 0; d < n; ++d) {
    const float wv = bf(w[static_cast<int64_t>(d) * w_stride]);
    const float4* s4 = reinterpret_cast<const float4*>(stage[d]);
#pragma unroll
    for (int k = 0; k < kAbsorbTokens / 4; ++k) {
      const float4 s = s4[k];
      acc[4 * k] += s.x * wv;
      acc[4 * k + 1] += s.y * wv;
      acc[4 * k + 2] += s.z * wv;
      acc[4 * k + 3] += s.w * wv;
    }
  }
}

// ---- 1. qc = W_UK_h^T q_nope_h, and the cache write.
__global__ void __launch_bounds__(kAbsorbThreads) query_absorb_kernel(MlaAbsorbedParams p, int t0, int tc,
                                                                        float* lat) {
  __shared__ __align__(16) float stage[kStageDepth][kStagePitch];
  const int h = blockIdx.x, tt0 = blockIdx.y * kAbsorbTokens, nt = min(kAbsorbTokens, tc - tt0);
  const int tid = threadIdx.x;
  if (h == 0) {  // every token of the pass enters the cache once, before the attention kernel runs
    const int width = p.R + p.rope;
    for (int tt = 0; tt < nt; ++tt) {
      const int t = t0 + tt0 + tt;
      bf16* row = p.cache + paged_cache_row(seq_pages(p, t), p.page_size, p.positions[t]) * width;
      const bf16* c = p.latent + static_cast<int64_t>(t) * p.ld_latent;
      const bf16* pe = p.k_pe + static_cast<int64_t>(t) * p.ld_k_pe;
      for (int i = tid; i < width; i += kAbsorbThreads) row[i] = i < p.R ? c[i] : pe[i - p.R];
    }
  }
  const int qh = p.nope + p.rope;
  const bf16* q = p.q + static_cast<int64_t>(t0 + tt0) * p.ld_q + static_cast<int64_t>(h) * qh;
  for (int i0 = 0; i0 < p.R; i0 += kAbsorbThreads) {
    const int i = i0 + tid;
    float acc[kAbsorbTokens];
#pragma unroll
    for (int tt = 0; tt < kAbsorbTokens; ++tt) acc[tt] = 0.0f;
    for (int d0 = 0; d0 < p.nope; d0 += kStageDepth) {
      const int nd = min(kStageDepth, p.nope - d0);
      __syncthreads();
      for (int idx = tid; idx < kStageDepth * kAbsorbTokens; idx += kAbsorbThreads) {
        const int tt = idx / kStageDepth, dd = idx % kStageDepth;
        stage[dd][tt] = tt < nt && dd < nd ? bf(q[static_cast<int64_t>(tt) * p.ld_q + d0 + dd]) : 0.0f;
      }
      __syncthreads();
      if (i < p.R) fma_staged(stage, p.w_uk + (static_cast<int64_t>(h) * p.nope + d0) * p.R + i, p.R, nd, acc);
    }
    if (i < p.R) {
      float* dst = lat + (static_cast<int64_t>(tt0) * p.heads + h) * p.R + i;
#pragma unroll
      for (int tt = 0; tt < kAbsorbTokens; ++tt)
        if (tt < nt) dst[static_cast<int64_t>(tt) * p.heads * p.R] = acc[tt];
    }
  }
}

// ---- 2. qc += A^T (B_UK_h^T q_nope_h) for the token's adapter: u = B_UK_h^T q_nope_h per head
// (rank values), then A^T u with each row of A read once for the block's heads.
__global__ void __launch_bounds__(kLoraThreads) lora_query_kernel(MlaAbsorbedParams p, int t0, float* lat) {
  __shared__ float u[kLoraHeads][kLoraMaxRank];
  const int tl = blockIdx.x, t = t0 + tl;
  const TokenLora lo = token_lora(p, t);
  if (lo.rank == 0) return;
  const int r = lo.rank, h0 = blockIdx.y * kLoraHeads, nh = min(kLoraHeads, p.heads - h0);
  const int F = p.nope + p.v_dim, qh = p.nope + p.rope;
  for (int idx = threadIdx.x; idx < nh * r; idx += kLoraThreads) {
    const int hc = idx / r, k = idx % r, h = h0 + hc;
    const bf16* qn = p.q + static_cast<int64_t>(t) * p.ld_q + static_cast<int64_t>(h) * qh;
    const bf16* bcol = lo.b + static_cast<int64_t>(h) * F * r + k;  // B row h*F + d, column k
    float s = 0.0f;
    for (int d = 0; d < p.nope; ++d) s += bf(qn[d]) * bf(bcol[static_cast<int64_t>(d) * r]);
    u[hc][k] = s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.R; i += kLoraThreads) {
    float acc[kLoraHeads];
#pragma unroll
    for (int hc = 0; hc < kLoraHeads; ++hc) acc[hc] = 0.0f;
    for (int k = 0; k < r; ++k) {
      const float a = bf(lo.a[static_cast<int64_t>(k) * p.R + i]);
#pragma unroll
      for (int hc = 0; hc < kLoraHeads; ++hc)
        if (hc < nh) acc[hc] += u[hc][k] * a;
    }
    float* dst = lat + (static_cast<int64_t>(tl) * p.heads + h0) * p.R + i;
#pragma unroll
    for (int hc = 0; hc < kLoraHeads; ++hc)
      if (hc < nh) dst[static_cast<int64_t>(hc) * p.R] += acc[hc];
  }
}

// ---- 3. Latent attention.
// Butterfly reduce-scatter of 32 per-lane partial sums: afterwards v[0] of lane L holds the sum over
// all lanes of the partials for row L (at step OFF a lane keeps the half of rows selected by its
// bit OFF and adds its partner's partials for that half): 31 shuffles for 32 sums instead of 160.
template <int OFF>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[kTile], int lane) {
  const bool upper = (lane & OFF) != 0;
#pragma unroll
  for (int i = 0; i < OFF; ++i) {
    const float send = upper ? v[i] : v[i + OFF];
    const float keep = upper ? v[i + OFF] : v[i];
    v[i] = keep + __shfl_xor_sync(kFull, send, OFF);
  }
}

// Stages cache rows [p0, p0 + cnt) of the sequence as bf16 pairs, rows padded with zeros to
// row_words words and rows >= cnt all zeros (so no stale or unwritten value is ever multiplied).
__device__ __forceinline__ void load_tile(const MlaAbsorbedParams& p, const int32_t* pages, int p0, int cnt,
                                          int width, int row_words, uint32_t* tile) {
  const bf16* cache = p.cache;
  if (width % 8 == 0) {  // rows start 16-byte aligned: 8 values per load
    const int chunks = row_words / 4;
    for (int idx = threadIdx.x; idx < kTile * chunks; idx += kAttnThreads) {
      const int r = idx / chunks, c = idx % chunks;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < cnt && c * 8 < width) v = ldg_u4(cache + paged_cache_row(pages, p.page_size, p0 + r) * width + c * 8);
      reinterpret_cast<uint4*>(tile + static_cast<int64_t>(r) * row_words)[c] = v;
    }
  } else {
    uint16_t* t16 = reinterpret_cast<uint16_t*>(tile);
    const int elems = 2 * row_words;
    for (int idx = threadIdx.x; idx < kTile * elems; idx += kAttnThreads) {
      const int r = idx / elems, e = idx % elems;
      uint16_t v = 0;
      if (r < cnt && e < width)
        v = __bfloat16_as_ushort(cache[paged_cache_row(pages, p.page_size, p0 + r) * width + e]);
      t16[idx] = v;
    }
  }
}

// Block (token, group of 8 heads, split); lane l of head h's warp owns the bf16 pairs l + 32k of
// the (qc, q_pe) / (c, k_pe) rows for the scores, and of c for the output.
__global__ void __launch_bounds__(kAttnThreads) latent_attention_kernel(MlaAbsorbedParams p, int t0, int splits,
                                                                          int split_positions, float* lat,
                                                                          float* part_o, float* part_stats) {
  extern __shared__ __align__(16) uint32_t tile[];
  const int tl = blockIdx.x, t = t0 + tl;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y * kAttnWarps + warp;
  const bool active = h < p.heads;  // warp-uniform; idle warps still help stage tiles
  const int n = p.positions[t] + 1;
  const int begin = blockIdx.z * split_positions, end = min(n, begin + split_positions);
  if (begin >= end) return;  // the whole block: this split lies past the token's context
  const int width = p.R + p.rope;
  const int words = (width + 63) / 64;  // pairs per lane per row
  const int row_words = 32 * words;
  const int out_words = (p.R + 63) / 64;  // pairs per lane of c
  const int32_t* pages = seq_pages(p, t);

  // The query, pre-scaled by scale * log2(e) so that exp2 of a score difference is the softmax's exp.
  float qa[kMaxWords], qb[kMaxWords];
  {
    const float qs = p.scale * kLog2e;
    const float* qc = lat + (static_cast<int64_t>(tl) * p.heads + h) * p.R;
    const bf16* qpe = p.q + static_cast<int64_t>(t) * p.ld_q + static_cast<int64_t>(h) * (p.nope + p.rope) + p.nope;
    auto q_at = [&](int e) { return e < p.R ? qc[e] : e < width ? bf(qpe[e - p.R]) : 0.0f; };
#pragma unroll
    for (int k = 0; k < kMaxWords; ++k) {
      const int e = 2 * (lane + 32 * k);
      qa[k] = active && k < words ? q_at(e) * qs : 0.0f;
      qb[k] = active && k < words ? q_at(e + 1) * qs : 0.0f;
    }
  }
  float m = -INFINITY, l = 0.0f;
  float oa[kMaxWords], ob[kMaxWords];
#pragma unroll
  for (int k = 0; k < kMaxWords; ++k) oa[k] = ob[k] = 0.0f;

  for (int p0 = begin; p0 < end; p0 += kTile) {
    const int cnt = min(kTile, end - p0);
    __syncthreads();  // the previous tile is consumed
    load_tile(p, pages, p0, cnt, width, row_words, tile);
    __syncthreads();
    if (!active) continue;
    float part[kTile];
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      const uint32_t* row = tile + j * row_words + lane;
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < kMaxWords; ++k)
        if (k < words) {
          const uint32_t w = row[32 * k];
          acc += qa[k] * bf16_bits_lo(w) + qb[k] * bf16_bits_hi(w);
        }
      part[j] = acc;
    }
    reduce_scatter_step<16>(part, lane);
    reduce_scatter_step<8>(part, lane);
    reduce_scatter_step<4>(part, lane);
    reduce_scatter_step<2>(part, lane);
    reduce_scatter_step<1>(part, lane);
    const float s = lane < cnt ? part[0] : -INFINITY;  // lane j: the score of row p0 + j
    const float m_new = fmaxf(m, warp_max(s));       // finite: the tile has a row
    const float alpha = exp2f(m - m_new);            // 0 on the first tile (m = -inf)
    const float pj = lane < cnt ? exp2f(s - m_new) : 0.0f;
    l = l * alpha + warp_sum(pj);
#pragma unroll
    for (int k = 0; k < kMaxWords; ++k) oa[k] *= alpha, ob[k] *= alpha;
    for (int j = 0; j < cnt; ++j) {
      const float w = __shfl_sync(kFull, pj, j);
      const uint32_t* row = tile + j * row_words + lane;
#pragma unroll
      for (int k = 0; k < kMaxWords; ++k)
        if (k < out_words) {
          const uint32_t x = row[32 * k];
          oa[k] += w * bf16_bits_lo(x);
          ob[k] += w * bf16_bits_hi(x);
        }
    }
    m = m_new;
  }
  if (!active) return;
  // One split: the normalised output replaces qc (only this warp ever reads these qc values).
  // Several: the unnormalised partial and its (max, sum) for merge_splits.
  float* dst;
  float norm = 1.0f;
  const int64_t row = static_cast<int64_t>(tl) * p.heads + h;
  if (splits == 1) {
    dst = lat + row * p.R;
    norm = 1.0f / l;
  } else {
    const int64_t ps = row * splits + blockIdx.z;
    dst = part_o + ps * p.R;
    if (lane == 0) part_stats[2 * ps] = m, part_stats[2 * ps + 1] = l;
  }
#pragma unroll
  for (int k = 0; k < kMaxWords; ++k) {
    const int e = 2 * (lane + 32 * k);
    if (k < out_words && e < p.R) dst[e] = oa[k] * norm;
    if (k < out_words && e + 1 < p.R) dst[e + 1] = ob[k] * norm;
  }
}

// ---- 4. Merge of the KV splits of each (token, head): o = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s
// over the splits that hold positions of the token (the others never ran).
__global__ void __launch_bounds__(128) merge_splits_kernel(MlaAbsorbedParams p, int t0, int splits,
                                                             int split_positions, float* lat, const float* part_o,
                                                             const float* part_stats) {
  __shared__ float weight[kMlaMaxSplits];
  const int64_t row = blockIdx.x;  // token-in-pass * heads + head
  const int t = t0 + static_cast<int>(row / p.heads);
  const int used = min(splits, (p.positions[t] + split_positions) / split_positions);
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

// ---- 6. out_h = W_UV_h o_h + B_UV_h u_h, rounded once to bf16.
__global__ void __launch_bounds__(kAbsorbThreads) output_absorb_kernel(MlaAbsorbedParams p, int t0, int tc,
                                                                         const float* lat, const float* ua) {
  __shared__ __align__(16) float stage[kStageDepth][kStagePitch];
  __shared__ const bf16* lora_b[kAbsorbTokens];
  __shared__ int lora_r[kAbsorbTokens];
  const int h = blockIdx.x, tt0 = blockIdx.y * kAbsorbTokens, nt = min(kAbsorbTokens, tc - tt0);
  const int tid = threadIdx.x, F = p.nope + p.v_dim;
  if (tid < kAbsorbTokens) {
    TokenLora lo;
    if (ua != nullptr && tid < nt) lo = token_lora(p, t0 + tt0 + tid);
    lora_b[tid] = lo.b;
    lora_r[tid] = lo.rank;
  }
  const float* src = lat + (static_cast<int64_t>(tt0) * p.heads + h) * p.R;
  for (int e0 = 0; e0 < p.v_dim; e0 += kAbsorbThreads) {
    const int e = e0 + tid;
    float acc[kAbsorbTokens];
#pragma unroll
    for (int tt = 0; tt < kAbsorbTokens; ++tt) acc[tt] = 0.0f;
    for (int i0 = 0; i0 < p.R; i0 += kStageDepth) {
      const int ni = min(kStageDepth, p.R - i0);
      __syncthreads();
      for (int idx = tid; idx < kStageDepth * kAbsorbTokens; idx += kAbsorbThreads) {
        const int tt = idx / kStageDepth, ii = idx % kStageDepth;
        stage[ii][tt] = tt < nt && ii < ni ? src[static_cast<int64_t>(tt) * p.heads * p.R + i0 + ii] : 0.0f;
      }
      __syncthreads();
      if (e < p.v_dim) fma_staged(stage, p.w_uv_t + (static_cast<int64_t>(h) * p.R + i0) * p.v_dim + e, p.v_dim, ni, acc);
    }
    if (e < p.v_dim) {
      const int64_t brow = static_cast<int64_t>(h) * F + p.nope + e;  // B_UV_h row e
#pragma unroll
      for (int tt = 0; tt < kAbsorbTokens; ++tt) {
        if (tt >= nt) continue;
        const int r = lora_r[tt];
        if (r > 0) {
          const bf16* b = lora_b[tt] + brow * r;
          const float* u = ua + (static_cast<int64_t>(tt0 + tt) * p.heads + h) * p.lora_rank_stride;
          float s = 0.0f;
          for (int k = 0; k < r; ++k) s += bf(b[k]) * u[k];
          acc[tt] += s;
        }
        p.out[static_cast<int64_t>(t0 + tt0 + tt) * p.ld_out + static_cast<int64_t>(h) * p.v_dim + e] =
            __float2bfloat16_rn(acc[tt]);
      }
    }
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
      p.w_uk[(static_cast<int64_t>(h) * p.nope + d) * p.R + col] = __float2bfloat16_rn(w);
    else
      p.w_uv_t[(static_cast<int64_t>(h) * p.R + col) * p.v_dim + (d - p.nope)] = __float2bfloat16_rn(w);
  }
}

}  // namespace

void launch_mla_absorbed(const MlaAbsorbedParams& p, const cuda_plan::MlaPlan& plan, void* scratch,
                         size_t scratch_bytes, cudaStream_t stream) {
  MOELORA_CHECK_MSG(p.T >= 0 && p.heads >= 1 && p.nope >= 0 && p.rope >= 0 && p.v_dim >= 1 && p.R >= 1 &&
                        p.page_size >= 1,
                    "absorbed MLA: T {}, heads {}, nope {}, rope {}, v {}, R {}, page size {}", p.T, p.heads, p.nope,
                    p.rope, p.v_dim, p.R, p.page_size);
  MOELORA_CHECK_MSG(p.R + p.rope <= kMlaMaxLatentWidth,
                    "absorbed MLA: cache rows of {} + {} values, the kernels take at most {}", p.R, p.rope,
                    kMlaMaxLatentWidth);
  MOELORA_CHECK_MSG(p.lora_a == nullptr || (p.lora_rank_stride >= 1 && p.lora_rank_stride <= kLoraMaxRank),
                    "absorbed MLA: LoRA rank stride {} outside 1..{}", p.lora_rank_stride, kLoraMaxRank);
  MOELORA_CHECK_MSG(plan.splits >= 1 && plan.splits <= kMlaMaxSplits && plan.split_positions % kTile == 0 &&
                        plan.chunk_tokens >= 1 && scratch_bytes >= plan.scratch_bytes(),
                    "absorbed MLA plan: {} splits of {} positions, {} tokens per pass, {} of {} scratch bytes",
                    plan.splits, plan.split_positions, plan.chunk_tokens, scratch_bytes, plan.scratch_bytes());
  if (p.T == 0) return;
  char* base = static_cast<char*>(scratch);
  float* lat = reinterpret_cast<float*>(base);
  float* part_o = reinterpret_cast<float*>(base + plan.latent_bytes);
  float* part_stats = reinterpret_cast<float*>(base + plan.latent_bytes + plan.partial_bytes);
  float* ua = p.lora_a ? reinterpret_cast<float*>(base + plan.latent_bytes + plan.partial_bytes + plan.stats_bytes)
                       : nullptr;
  const int head_groups = ceil_div(p.heads, kAttnWarps);
  const int lora_groups = ceil_div(p.heads, kLoraHeads);
  const size_t tile_bytes = sizeof(uint32_t) * kTile * 32 * ((p.R + p.rope + 63) / 64);
  for (int t0 = 0; t0 < p.T; t0 += plan.chunk_tokens) {
    const int tc = std::min(plan.chunk_tokens, p.T - t0);
    const int tiles = ceil_div(tc, kAbsorbTokens);
    query_absorb_kernel<<<dim3(p.heads, tiles), kAbsorbThreads, 0, stream>>>(p, t0, tc, lat);
    MOELORA_CUDA_CHECK_LAUNCH();
    if (ua) {
      lora_query_kernel<<<dim3(tc, lora_groups), kLoraThreads, 0, stream>>>(p, t0, lat);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    latent_attention_kernel<<<dim3(tc, head_groups, plan.splits), kAttnThreads, tile_bytes, stream>>>(
        p, t0, plan.splits, plan.split_positions, lat, part_o, part_stats);
    MOELORA_CUDA_CHECK_LAUNCH();
    if (plan.splits > 1) {
      merge_splits_kernel<<<tc * p.heads, 128, 0, stream>>>(p, t0, plan.splits, plan.split_positions, lat, part_o,
                                                             part_stats);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    if (ua) {
      lora_output_shrink_kernel<<<dim3(tc, lora_groups), kLoraThreads, sizeof(float) * kLoraHeads * p.R, stream>>>(
          p, t0, lat, ua);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
    output_absorb_kernel<<<dim3(p.heads, tiles), kAbsorbThreads, 0, stream>>>(p, t0, tc, lat, ua);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
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
