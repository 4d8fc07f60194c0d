// Decode attention (attention.cuh): one block per (token, kv head x head tile, split), 4 warps
// splitting the split's positions in 16-position tiles, warps merged in shared memory, splits by the
// combine kernel in attention.cu; the query heads are the MMA's columns.
//
// Why this form: decode reads every cached K/V byte once for ~2 flops per byte per query head of
// the group, so the kernel must keep many bytes in flight and spend few instructions per byte. The
// kernel before it gave GQA's 8 query heads 16 MMA rows (half of every MMA wasted), moved each
// lane's own pieces of a tile with byte permutes and 64 rescales per 16 keys, and reached ~55 % of
// the copy bandwidth; this one reaches 78-106 % from 128 sequences (bench/RESULTS.md, paged decode
// attention 2026-12-04). Here:
// - S^T = K Q^T: the tile's 16 positions are the MMA's rows (A operand: ldmatrix of the K tile in
//   shared memory), 8 query heads its columns (B operand: registers, loaded once per block).
// - online softmax per head (a column): max over the tile's positions by 3 shuffles; the row sums
//   stay per lane until the end.
// - O^T += V^T P^T: head dims are the rows (A operand: ldmatrix.trans of the V tile), the
//   probabilities the B operand, which is the S^T accumulator transposed by movmatrix (no shared
//   memory round trip). P is rounded to bf16 as in the other kernels (docs/numerics.md).
// - each warp streams its tiles by cp.async, `stages` deep, whole 16-byte pieces of cache rows (a
//   warp instruction moves two 256-byte rows at Qwen3's 128 dims), into rows padded by 16 bytes so
//   that ldmatrix's 8 rows fall in distinct banks. With page_size % 16 == 0 a tile (16 positions
//   aligned to 16) lies in one page: one page-table entry per tile, loaded a tile ahead so the
//   lookup is off the issue path.
// K/V pieces of positions at or past the token's end are zero-filled, never read (a cache row
// nobody wrote may hold NaN, and 0 * NaN would reach the output).
#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/attention_internal.cuh"

namespace moelora::cuda::attention_detail {
namespace {

// The 8x8 bf16 matrix held one row pair per lane (lane 4g + t: row g, columns 2t, 2t+1), transposed.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// cp.async.wait_group takes an immediate: the stage counts the plan may ask for.
__device__ __forceinline__ void cp_async_wait_stages(int in_flight) {
  if (in_flight <= 1) cp_async_wait<1>();
  else if (in_flight == 2) cp_async_wait<2>();
  else cp_async_wait<3>();
}

constexpr int kMaxStages = 4;

template <int DK, int DV, int NT>
struct Cols {
  static constexpr int TP = 16;                    // positions per warp tile (the MMA's rows)
  static constexpr int KS = DK / 16, MT = DV / 16;  // k-steps of S^T, row tiles of O^T
  static constexpr int HEADS = 8 * NT;             // query heads per block (NT MMA column tiles)
  static constexpr int KRow = DK + 8, VRow = DV + 8;  // padded shared rows, bf16
  static constexpr int kStageElems = TP * (KRow + VRow);
  static constexpr int kMergeBytes = kWarps * HEADS * (DV + 4) * 4 + 2 * kWarps * HEADS * 4;
  static_assert(DK % 16 == 0 && DV % 16 == 0, "head dims");
  // What the block allocates: cuda_plan's size (its wave model reads the same number), which must
  // hold this layout's stages and merge area at every depth.
  static constexpr int smem_bytes(int stages) {
    return cuda_plan::attention_decode_smem_bytes(DK, DV, HEADS, stages);
  }
  static_assert(smem_bytes(2) >= 2 * kWarps * kStageElems * 2 && smem_bytes(2) >= kMergeBytes &&
                    smem_bytes(kMaxStages) >= kMaxStages * kWarps * kStageElems * 2,
                "cuda_plan::attention_decode_smem_bytes does not cover the kernel's shared memory");
};

// One warp's copy of the K and V rows of positions [p0, p0 + 16) into stage `st` (zeros for
// positions >= kend). row0: the cache row of p0 when the tile lies in one page, else -1.
template <int DK, int DV, int NT>
__device__ __forceinline__ void issue_tile(const KParams& p, int seq_base, int kvh, int p0, int kend, int64_t row0,
                                           bf16* st, int lane) {
  using C = Cols<DK, DV, NT>;
  constexpr int KCH = DK / 8, VCH = DV / 8;  // 16-byte pieces per row
  const int64_t kw = static_cast<int64_t>(p.a.kv_heads) * DK, vw = static_cast<int64_t>(p.a.kv_heads) * DV;
#pragma unroll
  for (int i = 0; i < C::TP * KCH / 32; ++i) {
    const int c = lane + 32 * i, r = c / KCH, ch = c % KCH;
    const bool ok = p0 + r < kend;
    const int64_t row = ok ? (row0 >= 0 ? row0 + r : cache_row(p, seq_base, p0 + r)) : 0;
    cp_async<16>(st + r * C::KRow + ch * 8, p.a.k_cache + row * kw + kvh * DK + ch * 8, ok);
  }
  bf16* vs = st + C::TP * C::KRow;
#pragma unroll
  for (int i = 0; i < C::TP * VCH / 32; ++i) {
    const int c = lane + 32 * i, r = c / VCH, ch = c % VCH;
    const bool ok = p0 + r < kend;
    const int64_t row = ok ? (row0 >= 0 ? row0 + r : cache_row(p, seq_base, p0 + r)) : 0;
    cp_async<16>(vs + r * C::VRow + ch * 8, p.a.v_cache + row * vw + kvh * DV + ch * 8, ok);
  }
}

template <int DK, int DV, int NT>
__global__ void __launch_bounds__(kThreads) attn_decode_cols_kernel(const __grid_constant__ KParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  using C = Cols<DK, DV, NT>;
  extern __shared__ __align__(16) unsigned char s_dyn[];
  const int tok = blockIdx.y;
  const int kvh = blockIdx.x / p.head_tiles, ht = blockIdx.x % p.head_tiles;
  const int split = blockIdx.z;
  const int n = p.a.positions[tok] + 1;
  const cuda_plan::AttentionTokenSplit ts = cuda_plan::attention_token_split(n, p.max_splits);
  if (split >= ts.count) return;  // this token has fewer splits (the combine reads only those it has)
  const int kbeg = split * ts.chunk, kend = min(n, kbeg + ts.chunk);
  const int seq_base = p.a.page_indptr[p.a.token_seq[tok]];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int stages = p.stages;
  constexpr int kStride = kWarps * C::TP;  // warp w takes the tiles kbeg + 16 w + 64 i
  const int first = kbeg + warp * C::TP;
  const int ntiles = first < kend ? (kend - first + kStride - 1) / kStride : 0;
  bf16* wbuf = reinterpret_cast<bf16*>(s_dyn) + warp * stages * C::kStageElems;
  // Cache row of tile i's first position when the tile lies in one page (else -1: per-row lookups).
  auto tile_row = [&](int i) -> int64_t {
    if (!p.tile_in_page || i >= ntiles) return -1;
    const int p0 = first + i * kStride, pi = page_of(p, p0);
    return static_cast<int64_t>(p.a.page_indices[seq_base + pi]) * p.a.page_size + (p0 - pi * p.a.page_size);
  };
  for (int i = 0; i < stages - 1; ++i) {
    if (i < ntiles) issue_tile<DK, DV, NT>(p, seq_base, kvh, first + i * kStride, kend, tile_row(i), wbuf + i * C::kStageElems, lane);
    cp_async_commit();
  }
  int64_t next_row = tile_row(stages - 1);

  // Q^T as the B operand: column g of tile nt is query head ht * HEADS + 8 nt + g of this kv head.
  uint32_t qb[C::KS][NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int hh = ht * C::HEADS + nt * 8 + g;
    const bool ok = hh < p.group;
    const bf16* qrow = p.a.q + static_cast<int64_t>(tok) * p.a.ld_q + static_cast<int64_t>(kvh * p.group + (ok ? hh : 0)) * DK;
#pragma unroll
    for (int ks = 0; ks < C::KS; ++ks) {
      qb[ks][nt][0] = ok ? __ldg(reinterpret_cast<const unsigned int*>(qrow + 16 * ks + 2 * t)) : 0u;
      qb[ks][nt][1] = ok ? __ldg(reinterpret_cast<const unsigned int*>(qrow + 16 * ks + 2 * t + 8)) : 0u;
    }
  }
  // Per head column j of tile nt (heads 2t + j): running max, this lane's share of the sum, and
  // O^T (rows 16 mt + g, 16 mt + g + 8 of the head dims).
  float m[NT][2], l[NT][2], o[C::MT][NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m[nt][0] = m[nt][1] = -INFINITY;
    l[nt][0] = l[nt][1] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
  }
  const int k_lane = (lane & 15) * C::KRow + (lane >> 4) * 8;
  const int v_lane = ((lane & 7) + ((lane >> 4) << 3)) * C::VRow + ((lane >> 3) & 1) * 8;

  for (int i = 0; i < ntiles; ++i) {
    __syncwarp();  // every lane is done reading the stage the next copy overwrites
    const int ahead = i + stages - 1;
    if (ahead < ntiles)
      issue_tile<DK, DV, NT>(p, seq_base, kvh, first + ahead * kStride, kend, next_row,
                             wbuf + (ahead % stages) * C::kStageElems, lane);
    cp_async_commit();
    next_row = tile_row(ahead + 1);  // used by the next iteration's copy: its latency hides behind this tile
    cp_async_wait_stages(stages - 1);
    __syncwarp();  // the tile's pieces copied by the other lanes are visible
    const bf16* kt = wbuf + (i % stages) * C::kStageElems;
    const uint32_t ka = smem_addr(kt + k_lane), va = smem_addr(kt + C::TP * C::KRow + v_lane);

    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < C::KS; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, ka + ks * 32);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_bf16_16816(s[nt], a, qb[ks][nt][0], qb[ks][nt][1]);
    }
    const int p0 = first + i * kStride;
    const bool lo_ok = p0 + g < kend, hi_ok = p0 + g + 8 < kend;  // rows g and g + 8 of the tile
    uint32_t pb[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float al[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float lo = lo_ok ? s[nt][j] * p.scale_log2 : -INFINITY;
        const float hi = hi_ok ? s[nt][2 + j] * p.scale_log2 : -INFINITY;
        float mx = fmaxf(lo, hi);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float mn = fmaxf(m[nt][j], mx);  // finite: position p0 is always inside
        al[j] = exp2f(m[nt][j] - mn);
        m[nt][j] = mn;
        s[nt][j] = exp2f(lo - mn);
        s[nt][2 + j] = exp2f(hi - mn);
        l[nt][j] = l[nt][j] * al[j] + s[nt][j] + s[nt][2 + j];
      }
      pb[nt][0] = movmatrix_trans(pack_bf16x2(s[nt][0], s[nt][1]));  // positions 2t, 2t+1 of head g
      pb[nt][1] = movmatrix_trans(pack_bf16x2(s[nt][2], s[nt][3]));  // positions 2t+8, 2t+9
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        o[mt][nt][0] *= al[0];
        o[mt][nt][1] *= al[1];
        o[mt][nt][2] *= al[0];
        o[mt][nt][3] *= al[1];
      }
    }
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, va + mt * 32);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_bf16_16816(o[mt][nt], a, pb[nt][0], pb[nt][1]);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], 4);
      l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], 8);
      l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], 16);
    }
  __syncthreads();  // every warp is done with its stages: the buffer becomes the merge area
  float(*s_o)[C::HEADS][DV + 4] = reinterpret_cast<float(*)[C::HEADS][DV + 4]>(s_dyn);
  float(*s_m)[C::HEADS] = reinterpret_cast<float(*)[C::HEADS]>(s_dyn + kWarps * C::HEADS * (DV + 4) * 4);
  float(*s_l)[C::HEADS] = reinterpret_cast<float(*)[C::HEADS]>(s_dyn + kWarps * C::HEADS * (DV + 4) * 4 + kWarps * C::HEADS * 4);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (g == 0) {
      s_m[warp][nt * 8 + 2 * t] = m[nt][0];
      s_m[warp][nt * 8 + 2 * t + 1] = m[nt][1];
      s_l[warp][nt * 8 + 2 * t] = l[nt][0];
      s_l[warp][nt * 8 + 2 * t + 1] = l[nt][1];
    }
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      s_o[warp][nt * 8 + 2 * t][16 * mt + g] = o[mt][nt][0];
      s_o[warp][nt * 8 + 2 * t + 1][16 * mt + g] = o[mt][nt][1];
      s_o[warp][nt * 8 + 2 * t][16 * mt + g + 8] = o[mt][nt][2];
      s_o[warp][nt * 8 + 2 * t + 1][16 * mt + g + 8] = o[mt][nt][3];
    }
  }
  __syncthreads();
  // Merge the warps (fixed order). Warp 0 always saw key kbeg, so M is finite; a warp without
  // tiles holds m = -inf, l = 0, o = 0 and adds nothing.
  for (int idx = threadIdx.x; idx < C::HEADS * DV; idx += kThreads) {
    const int row = idx / DV, col = idx % DV;
    const int hh = ht * C::HEADS + row;
    if (hh >= p.group) continue;
    float M = s_m[0][row];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) M = fmaxf(M, s_m[w][row]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(s_m[w][row] - M);
      L += s_l[w][row] * f;
      O += s_o[w][row][col] * f;
    }
    const int h = kvh * p.group + hh;
    if (p.max_splits == 1) {
      p.a.out[static_cast<int64_t>(tok) * p.a.ld_out + static_cast<int64_t>(h) * DV + col] = __float2bfloat16(O / L);
    } else {
      float* w = p.ws + ((static_cast<int64_t>(tok) * p.a.heads + h) * p.max_splits + split) * (DV + 2);
      w[col] = O / L;
      if (col == 0) {
        w[DV] = M;
        w[DV + 1] = L;
      }
    }
  }
}

template <int DK, int DV, int NT>
void launch_cols(const KParams& k, cudaStream_t stream) {
  using C = Cols<DK, DV, NT>;
  KParams kp = k;
  kp.stages = std::clamp(k.stages, 2, kMaxStages);
  const int smem = C::smem_bytes(kp.stages);
  MOELORA_CHECK(cuda_plan::attention_decode_heads_per_block(k.group) == C::HEADS);
  const dim3 grid(k.a.kv_heads * k.head_tiles, k.a.T, k.max_splits);
  launch_pdl(attn_decode_cols_kernel<DK, DV, NT>, dim3(grid), dim3(kThreads), smem, stream, kp);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <int DK, int DV>
void launch_decode(const KParams& k, cudaStream_t stream) {
  if (k.group <= 8) launch_cols<DK, DV, 1>(k, stream);
  else launch_cols<DK, DV, 2>(k, stream);
}

template <int DK, int DV>
void decode_prepare() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(attn_decode_cols_kernel<DK, DV, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Cols<DK, DV, 1>::smem_bytes(kMaxStages)));
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(attn_decode_cols_kernel<DK, DV, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Cols<DK, DV, 2>::smem_bytes(kMaxStages)));
}

// The head dims attention_head_dims_supported() lists.
#define MOELORA_ATTENTION_DECODE_DIMS(DK, DV)                                        \
  template void launch_decode<DK, DV>(const KParams& k, cudaStream_t stream); \
  template void decode_prepare<DK, DV>();
MOELORA_ATTENTION_DECODE_DIMS(32, 32)
MOELORA_ATTENTION_DECODE_DIMS(48, 32)
MOELORA_ATTENTION_DECODE_DIMS(48, 48)
MOELORA_ATTENTION_DECODE_DIMS(64, 64)
MOELORA_ATTENTION_DECODE_DIMS(128, 128)
MOELORA_ATTENTION_DECODE_DIMS(192, 128)
#undef MOELORA_ATTENTION_DECODE_DIMS

}  // namespace moelora::cuda::attention_detail
