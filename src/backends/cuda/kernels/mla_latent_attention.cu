// DeepSeek MLA, absorbed form: the latent attention (step 3) and the merge of its KV splits (step
// 4); the design notes are at the top of mla_attention.cu, the math in mla_attention.cuh.
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/mla_attention.cuh"
#include "backends/cuda/kernels/mla_internal.cuh"
#include "backends/cuda_plan/mla_choices.h"

namespace moelora::cuda {
namespace {

using cuda_plan::kMlaMaxLatent;
using cuda_plan::kMlaMaxSplits;
using cuda_plan::kMlaTilePositions;
using mla_internal::aligned16;
using mla_internal::bf;
using mla_internal::seq_pages;

constexpr float kLog2e = 1.4426950408889634f;

// Warp pairs of 16 heads, 64 positions per tile.
constexpr int kTile = kMlaTilePositions;
constexpr int kMaxRowGroups = cuda_plan::kMlaMaxHeadsPerBlock / 16;
constexpr int kMaxHalfTiles = kMlaMaxLatent / 2 / 8;  // n-tiles of 8 columns in half of O
static_assert(kTile == 64, "the S fragments below cover 8 n-tiles of 8 positions");
static_assert(cuda_plan::kMlaMaxHeadsPerBlock % 16 == 0, "row groups of 16 heads");

int max_dynamic_smem() {
  static const int bytes = [] {
    int dev = 0, v = 0;
    MOELORA_CUDA_CHECK(cudaGetDevice(&dev));
    MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return v;
  }();
  return bytes;
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

}  // namespace

namespace mla_internal {

void launch_latent_attention(const MlaAbsorbedParams& p, int t0, int tc, int splits, float* lat, float* part_o,
                             float* part_stats, cudaStream_t stream) {
  const LatentShape sh = latent_shape(p.heads, p.R, p.rope, max_dynamic_smem());
  const int attn_smem = latent_smem_bytes(sh);
  MOELORA_CHECK_MSG(attn_smem <= max_dynamic_smem(), "absorbed MLA: {} bytes of shared memory, the GPU has {}",
                    attn_smem, max_dynamic_smem());
  const int head_groups = ceil_div(p.heads, 16 * sh.row_groups);
  launch_pdl(latent_attention_kernel, dim3(tc, head_groups, splits), dim3(64 * sh.row_groups),
             static_cast<size_t>(attn_smem), stream, p, sh, t0, splits, lat, part_o, part_stats);
  MOELORA_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    launch_pdl(merge_splits_kernel, dim3(tc * p.heads), dim3(128), 0, stream, p, t0, splits, lat,
               static_cast<const float*>(part_o), static_cast<const float*>(part_stats));
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

void latent_attention_prepare() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(latent_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          max_dynamic_smem()));
}

}  // namespace mla_internal
}  // namespace moelora::cuda
