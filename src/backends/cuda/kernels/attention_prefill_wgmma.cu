// Prefill attention on Hopper's warpgroup MMA (cuda_plan::AttentionPrefillKernel::kWgmma), the
// semantics of attention.cuh, for head dims that are multiples of 64.
//
// Why: the mma.sync prefill kernel (attention.cu) has each warp read its own K/V rows from global
// memory, 16 positions at a time, and reached 54 TFLOP/s on a 4k prompt (H200, 2026-12-03; the
// attention issue asks >= 300). Here a block's K/V tile is read once into shared memory for 128
// query rows, and both products run on wgmma, B straight from shared memory (no ldmatrix, no
// register traffic for K and V).
//
// Block = 2 warpgroups, 128 (token, head) rows of one sequence and one kv head (rows r = token *
// group + head, as the mma.sync kernel; warpgroup w takes rows 64w..64w+63, the wgmma's M).
// - K/V tiles of 64 positions, kStages deep, copied by cp.async as 16-byte pieces into the
//   128-byte swizzle (wgmma.cuh): head dim d of position j lands in 64-wide column d / 64, row j.
//   Positions at or past the block's last row's position + 1 are zero-filled, never read: no
//   unwritten (possibly NaN) cache row and no page-table entry past a sequence's end is touched.
// - S = Q K^T: one m64n64k16 wgmma per 16 head dims, Q from registers (loaded once, A fragments),
//   K K-major (desc_sw128).
// - Online softmax in f32 in the exp2 domain on the accumulators (a quad of lanes holds a row's
//   64 scores), the causal mask per row (position <= the row's token position). P is rounded to
//   bf16 into A fragments for P V (as the mma.sync kernel and FlashAttention do).
// - O += P V: per 16 positions and 64-wide column of V one m64n64k16 wgmma with V N-major
//   (TRANS_B = 1, desc_mn_sw128): V's rows are positions, exactly the K tile's layout.
// - A warpgroup skips the MMAs of tiles past its own rows' last position (causal); it still takes
//   part in the block's barriers.
#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/attention_internal.cuh"
#include "backends/cuda/kernels/wgmma.cuh"
#include "backends/cuda_plan/sw128_layout.h"

namespace moelora::cuda::attention_detail {
namespace {

using namespace sm90;

constexpr int kWgRows = 64;  // query rows per warpgroup: the wgmma's M
constexpr int kWarpgroups = 2;
constexpr int kBlockRows = kWgRows * kWarpgroups;
constexpr int kBlockThreads = kWarpgroups * 128;
constexpr int kTileKeys = 64;  // positions per K/V tile: S's N
constexpr int kStages = 3;     // tiles in flight: 1 block per SM (registers), so the ring hides the latency
static_assert(kBlockRows == cuda_plan::kAttentionPrefillRowsWgmma, "the plan's items are sized for this block");
static_assert(kBlockThreads == kTileKeys * 4, "the loader gives each position 4 threads");

template <int DK, int DV>
struct PrefillTile {
  static_assert(DK % 64 == 0 && DV % 64 == 0, "64-wide swizzle columns");
  static constexpr int kColBytes = kTileKeys * cuda_plan::kSw128RowBytes;  // one 64-wide column: 64 rows x 128 bytes
  static constexpr int kKBytes = (DK / 64) * kColBytes;
  static constexpr int kVBytes = (DV / 64) * kColBytes;
  static constexpr int kStageBytes = kKBytes + kVBytes;
  static constexpr int kSmem = cuda_plan::kSw128AtomBytes + kStages * kStageBytes;  // + slack to align the ring
};

// This thread's position of a tile (p0 + tid / 4; positions at or past `end` are zero-filled) and
// its cache row: one page-table read per position, by its first thread, shared with the other three.
struct TileRow {
  bool ok;
  int64_t row;
};
__device__ __forceinline__ TileRow tile_row(const KParams& p, int seq_base, int p0, int end, int tid) {
  const int pos = p0 + (tid >> 2);
  const bool ok = pos < end;
  int64_t row = ok && (tid & 3) == 0 ? cache_row(p, seq_base, pos) : 0;
  row = __shfl_sync(0xffffffffu, row, (tid & 31) & ~3);
  return TileRow{ok, row};
}

// Copies the D head dims of kv head kvh of this thread's position (tile_row) from `cache` into one
// tile: position j = tid / 4, pieces q = tid % 4 + 4i.
template <int D>
__device__ __forceinline__ void load_tile_part(const KParams& p, const bf16* cache, uint8_t* dst, TileRow tr, int kvh,
                                               int tid) {
  const int j = tid >> 2, sub = tid & 3;
  const bool ok = tr.ok;
  const bf16* src = cache + tr.row * (static_cast<int64_t>(p.a.kv_heads) * D) + static_cast<int64_t>(kvh) * D;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const int q = sub + 4 * i;  // 16-byte piece of the row: 8 head dims
    uint8_t* d = dst + cuda_plan::sw128_piece_offset(kTileKeys, j, q);
    cp_async<16>(d, src + q * 8, ok);
  }
}

template <int DK, int DV>
__global__ void __launch_bounds__(kBlockThreads, 1) attn_prefill_wgmma_kernel(const __grid_constant__ KParams p) {
  using C = PrefillTile<DK, DV>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int lim_max[kBlockThreads / 32];
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  constexpr uintptr_t kAtom = cuda_plan::kSw128AtomBytes;
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + kAtom - 1) & ~(kAtom - 1));
  const int first = p.items[2 * blockIdx.x], count = p.items[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int rows_total = count * p.group;
  const int block_row0 = blockIdx.z * kBlockRows;
  if (block_row0 >= rows_total) return;  // the whole block: before any barrier
  const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = block_row0 + wg * kWgRows + (warp & 3) * 16 + g, r1 = r0 + 8;
  const bool v0 = r0 < rows_total, v1 = r1 < rows_total;
  const int tok0 = first + (v0 ? r0 : 0) / p.group, tok1 = first + (v1 ? r1 : 0) / p.group;
  const int h0 = kvh * p.group + (v0 ? r0 : 0) % p.group, h1 = kvh * p.group + (v1 ? r1 : 0) % p.group;
  const int lim0 = v0 ? p.a.positions[tok0] : -1, lim1 = v1 ? p.a.positions[tok1] : -1;
  const int seq_base = p.a.page_indptr[p.a.token_seq[first]];

  // The last position each warpgroup's rows see, and the block's: which tiles to load and compute.
  int lm = max(lim0, lim1);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lm = max(lm, __shfl_xor_sync(0xffffffffu, lm, o));
  if (lane == 0) lim_max[warp] = lm;
  __syncthreads();
  int wg_end = -1, block_end = -1;
#pragma unroll
  for (int w = 0; w < kBlockThreads / 32; ++w) {
    block_end = max(block_end, lim_max[w]);
    if (w / 4 == wg) wg_end = max(wg_end, lim_max[w]);
  }
  ++wg_end, ++block_end;  // positions < end
  const int n_tiles = (block_end + kTileKeys - 1) / kTileKeys;

  // Q's A fragments, k-step s = head dims 16s..16s+15: {row g: 2t, 2t+1}, {row g+8: 2t, 2t+1},
  // {row g: 2t+8, 2t+9}, {row g+8: 2t+8, 2t+9} as bf16x2 words.
  uint32_t qa[DK / 16][4];
  {
    const uint32_t* q0 = reinterpret_cast<const uint32_t*>(p.a.q + static_cast<int64_t>(tok0) * p.a.ld_q + static_cast<int64_t>(h0) * DK);
    const uint32_t* q1 = reinterpret_cast<const uint32_t*>(p.a.q + static_cast<int64_t>(tok1) * p.a.ld_q + static_cast<int64_t>(h1) * DK);
#pragma unroll
    for (int s = 0; s < DK / 16; ++s) {
      qa[s][0] = v0 ? __ldg(q0 + 8 * s + t) : 0u;
      qa[s][1] = v1 ? __ldg(q1 + 8 * s + t) : 0u;
      qa[s][2] = v0 ? __ldg(q0 + 8 * s + 4 + t) : 0u;
      qa[s][3] = v1 ? __ldg(q1 + 8 * s + 4 + t) : 0u;
    }
  }

  auto load = [&](int tile) {
    uint8_t* st = ring + (tile % kStages) * C::kStageBytes;
    const TileRow tr = tile_row(p, seq_base, tile * kTileKeys, block_end, tid);
    load_tile_part<DK>(p, p.a.k_cache, st, tr, kvh, tid);
    load_tile_part<DV>(p, p.a.v_cache, st + C::kKBytes, tr, kvh, tid);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load(s);
    cp_async_commit();
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DV / 64][32];
#pragma unroll
  for (int c = 0; c < DV / 64; ++c)
#pragma unroll
    for (int e = 0; e < 32; ++e) o[c][e] = 0.0f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    // The stage refilled here was last read in the previous iteration, which ended in a barrier.
    if (tile + kStages - 1 < n_tiles) load(tile + kStages - 1);
    cp_async_commit();                // possibly empty: keeps the group count per iteration fixed
    cp_async_wait<kStages - 1>();     // this thread's pieces of `tile` have landed
    fence_proxy_async_shared();       // ... and are visible to wgmma's (async-proxy) reads
    __syncthreads();                  // ... as everybody else's are
    const int p0 = tile * kTileKeys;
    if (p0 < wg_end) {  // uniform per warpgroup: wgmma is warpgroup-collective
      const uint32_t k_s = smem_u32(ring + (tile % kStages) * C::kStageBytes);
      const uint32_t v_s = k_s + C::kKBytes;
      float s[32];
      fence_operands(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < DK / 16; ++ks)
        Wgmma<64>::mma(s, qa[ks], desc_sw128(k_s + (ks >> 2) * C::kColBytes + (ks & 3) * 32), ks > 0);
      wgmma_commit();
      wgmma_wait0();
      fence_operands(s);
      // s[4j + e]: row g + 8 (e / 2), position p0 + 8j + 2t + e % 2.
      float(&sj)[8][4] = reinterpret_cast<float(&)[8][4]>(s);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = p0 + 8 * j + 2 * t + (e & 1);
          sj[j][e] = pos <= (e < 2 ? lim0 : lim1) ? sj[j][e] * p.scale_log2 : -INFINITY;
        }
      float al0, al1;
      online_softmax_step(sj, m, l, al0, al1);
#pragma unroll
      for (int c = 0; c < DV / 64; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          o[c][4 * j + 0] *= al0;
          o[c][4 * j + 1] *= al0;
          o[c][4 * j + 2] *= al1;
          o[c][4 * j + 3] *= al1;
        }
      // P's A fragments, k-step kk = positions p0 + 16kk..: score blocks 2kk (2t, 2t+1) and 2kk+1 (2t+8, 2t+9).
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
      }
#pragma unroll
      for (int c = 0; c < DV / 64; ++c) fence_operands(o[c]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) fence_operands(pa[kk]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int c = 0; c < DV / 64; ++c)
          Wgmma<64, 1>::mma(o[c], pa[kk], desc_mn_sw128(v_s + c * C::kColBytes + kk * 16 * 128, C::kColBytes), 1);
      wgmma_commit();
      wgmma_wait0();
#pragma unroll
      for (int c = 0; c < DV / 64; ++c) fence_operands(o[c]);
    }
    __syncthreads();  // every warpgroup is done with this stage before it is refilled
  }
  cp_async_wait<0>();  // no copy outlives the block (the trailing groups are empty)
  float inv0, inv1;
  row_normalisers(l, v0, v1, inv0, inv1);
  bf16* out0 = p.a.out + static_cast<int64_t>(tok0) * p.a.ld_out + static_cast<int64_t>(h0) * DV;
  bf16* out1 = p.a.out + static_cast<int64_t>(tok1) * p.a.ld_out + static_cast<int64_t>(h1) * DV;
#pragma unroll
  for (int c = 0; c < DV / 64; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = c * 64 + 8 * j + 2 * t;
      if (v0) {
        out0[col] = __float2bfloat16(o[c][4 * j + 0] * inv0);
        out0[col + 1] = __float2bfloat16(o[c][4 * j + 1] * inv0);
      }
      if (v1) {
        out1[col] = __float2bfloat16(o[c][4 * j + 2] * inv1);
        out1[col + 1] = __float2bfloat16(o[c][4 * j + 3] * inv1);
      }
    }
}

}  // namespace

template <int DK, int DV>
void launch_prefill_wgmma(const KParams& k, int num_items, cudaStream_t stream) {
  const int zc = (k.tokens_per_item * k.group + kBlockRows - 1) / kBlockRows;
  const dim3 grid(num_items, k.a.kv_heads, zc);
  launch_pdl(attn_prefill_wgmma_kernel<DK, DV>, grid, dim3(kBlockThreads), PrefillTile<DK, DV>::kSmem, stream, k);
  MOELORA_CUDA_CHECK_LAUNCH();
}

template <int DK, int DV>
void prefill_wgmma_prepare() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(attn_prefill_wgmma_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          PrefillTile<DK, DV>::kSmem));
}

// The head dims cuda_plan::attention_prefill_wgmma_built lists.
#define MOELORA_ATTENTION_PREFILL_WGMMA_DIMS(DK, DV)                                           \
  template void launch_prefill_wgmma<DK, DV>(const KParams& k, int num_items, cudaStream_t stream); \
  template void prefill_wgmma_prepare<DK, DV>();
MOELORA_ATTENTION_PREFILL_WGMMA_DIMS(64, 64)
MOELORA_ATTENTION_PREFILL_WGMMA_DIMS(128, 128)
MOELORA_ATTENTION_PREFILL_WGMMA_DIMS(192, 128)
#undef MOELORA_ATTENTION_PREFILL_WGMMA_DIMS

}  // namespace moelora::cuda::attention_detail
