// Grouped expert GEMMs (see moe_gemm.cuh for the math and the layouts).
//
// "Swap AB": the MMA's M side is the weight rows (output features), its N side the tokens of a
// tile, so a decode tile of 1..8 tokens wastes at most 7/8 of an n8 column block instead of 15/16
// of an m16 row block. One work item = (tile of <= BT tokens of one expert) x (block of weight
// rows); gate_up items pair gate rows with the up rows of the same features so SwiGLU happens in
// the epilogue. Items are ordered so that the tiles of one expert for one row block are adjacent
// (an expert with two tiles reads its weights from HBM once, from L2 the second time) and are
// assigned statically to a persistent grid; an item's metadata is loaded one item ahead and the
// next item's first weight chunks are warmed into L2 halfway through the current one, so a CTA
// does not stall on dependent latencies between items (run 1 on the H200 lost ~half the
// bandwidth there).
//
// Data movement: every K group (WM warps) streams 64-wide K chunks of its weight rows and of the
// token tile through a cp.async ring of STAGES stages in shared memory. Decode tiles use 4 K
// groups of one warp each (4 warps split K, each with a private ring, summed at the end): many
// small items keep every SM busy even for one token. The prefill tile uses one K group of 4 warps
// that split the weight rows and share the token tile.
//
// Fragment mapping (thread lane = 4 g + c): the MMA's k slots {2c, 2c+1, 2c+8, 2c+9} of step s
// carry real k = 16c + 4s + {0, 1, 2, 3} of the 64-wide chunk. So a thread needs 16 contiguous
// bytes of an FP8 weight row (or 32 of bf16) and 32 contiguous bytes of a token row per chunk:
// plain 16-byte shared loads, conflict-free with the row strides below, no ldmatrix. NVFP4: the
// same 16 k are one 8-byte group of packed codes (cuda_plan/nvfp4_layout.h) plus one scale byte.
#include <algorithm>
#include <mutex>

#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_gemm.cuh"
#include "backends/cuda/kernels/nvfp4_device.cuh"

namespace moelora::cuda {

// Host helpers are plain functions, not lambdas: with --expt-relaxed-constexpr nvcc treats the
// (implicitly constexpr) lambdas as device functions and chokes on fmt inside the checks.
static int query_num_sms() {
  int dev = 0, sms = 0;
  MOELORA_CUDA_CHECK(cudaGetDevice(&dev));
  MOELORA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

int moe_num_sms() {
  static const int n = query_num_sms();
  return n;
}

namespace {

using namespace moe_detail;

template <MoeWeightType WT_, int MT_, int NT_, int WM_, int WK_, int STAGES_, bool GATE_UP_, bool A8_ = false>
struct Cfg {
  static constexpr bool kFp8 = WT_ == MoeWeightType::kFp8;
  static constexpr bool kFp4 = WT_ == MoeWeightType::kNvfp4;
  static constexpr bool kA8 = A8_;  // W8A8: e4m3 token rows + per-token scales, e4m3 MMA
  static_assert(!A8_ || WT_ == MoeWeightType::kFp8, "W8A8 needs FP8 weights");
  static constexpr int MT = MT_, NT = NT_, WM = WM_, WK = WK_, STAGES = STAGES_;
  static constexpr bool kGateUp = GATE_UP_;
  static constexpr int kThreads = WM * WK * 32;
  static constexpr int kRows = WM * MT * 16;       // weight rows per item
  static constexpr int kBT = NT * 8;               // tokens per tile
  static constexpr int kChunkBytes = kFp4 ? 32 : kFp8 ? 64 : 128;  // global bytes of a row's 64-wide chunk
  static constexpr int kWPieces = kChunkBytes / 16;                 // its 16-byte pieces
  static constexpr int kWRow = kFp4 ? 32 : kFp8 ? 64 : 144;        // smem bytes per weight row (bf16: +16 pad)
  // NVFP4: the chunk's group scales of the item's rows, [kRows / 16][16][4] as stored (one 16-byte
  // piece per 4 rows).
  static constexpr int kWScale = kFp4 ? kRows * 4 : 0;
  // Token rows: bf16 144 bytes (+16 pad); e4m3 64 bytes, unpadded like the FP8 weight rows (a
  // quarter warp's 16-byte reads then cover 8 distinct bank quads).
  static constexpr int kXRow = A8_ ? 64 : 144;
  static constexpr int kXPieces = A8_ ? 4 : 8;     // 16-byte pieces of a 64-wide token row chunk
  static constexpr int kXScale = A8_ ? kBT * 4 : 0;  // the tile's activation scales of the chunk's group
  static constexpr int kXOff = kRows * kWRow + kWScale;           // token rows within a stage
  static constexpr int kStage = kXOff + kBT * kXRow + kXScale;
  static constexpr int kGroupThreads = WM * 32;
  static constexpr int kWPer = kRows * kWPieces / kGroupThreads;  // weight pieces per thread per chunk
  static constexpr int kXPer = kBT * kXPieces / kGroupThreads;   // token pieces per thread per chunk
  static constexpr int kRedStride = kRows + 4;                    // floats; conflict-free fragment stores
  static constexpr int kPipeBytes = WK * STAGES * kStage;
  static constexpr int kRedBytes = WK * kBT * kRedStride * 4;
  static constexpr int kSmem = kPipeBytes > kRedBytes ? kPipeBytes : kRedBytes;
  static_assert(kRows * kWPieces % kGroupThreads == 0 && kBT * kXPieces % kGroupThreads == 0, "piece split");
  static_assert(kBT <= kThreads, "one thread per tile row fills the row tables");
  static_assert(!A8_ || kBT <= kGroupThreads, "one thread of each K group copies a token's scale");
  static_assert(kWScale / 16 <= kGroupThreads, "one thread of each K group copies a piece of group scales");
  static_assert(kStage % 16 == 0, "16-byte aligned stages");
  static_assert(!GATE_UP_ || (WM * MT) % 2 == 0, "gate and up halves must be whole m16 tiles");
};

__device__ __forceinline__ void group_sync(int wk, int group_threads) {
  if (group_threads == 32)
    __syncwarp();
  else
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + wk), "r"(group_threads) : "memory");
}

// A lane's 16 bf16 token values of a chunk (32 contiguous shared-memory bytes) as the B registers
// of the chunk's 4 MMA steps (xw[2s], xw[2s + 1] for step s).
__device__ __forceinline__ void token_frags(const uint8_t* xr, uint32_t (&xw)[8]) {
  const uint4 xa = *reinterpret_cast<const uint4*>(xr);
  const uint4 xb = *reinterpret_cast<const uint4*>(xr + 16);
  xw[0] = xa.x, xw[1] = xa.y, xw[2] = xa.z, xw[3] = xa.w;
  xw[4] = xb.x, xw[5] = xb.y, xw[6] = xb.z, xw[7] = xb.w;
}

template <class C>
__global__ void __launch_bounds__(C::kThreads) moe_gemm_kernel(const __grid_constant__ MoeGemmParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_xrow[C::kBT];
  __shared__ int s_pair[C::kBT];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % C::WM, wk = warp / C::WM;  // K group wk = WM consecutive warps
  const int gtid = tid - wk * C::kGroupThreads;
  const int g = lane >> 2, c4 = lane & 3;

  const int K = C::kGateUp ? p.H : p.I;
  const int rows_per_expert = C::kGateUp ? 2 * p.I : p.H;
  const int half = C::kRows / 2;
  const int nb_step = C::kGateUp ? half : C::kRows;  // features (gate_up) or rows (down) per item
  const int nblocks = (C::kGateUp ? p.I : p.H) / nb_step;
  const int nchunks = K / 64;
  const int64_t w_row_bytes = static_cast<int64_t>(K) * C::kChunkBytes / 64;
  const int sblocks_i = (p.I + 127) / 128;
  const int scale_rows_per_expert = C::kGateUp ? 2 * sblocks_i : (p.H + 127) / 128;
  const int scale_cols = (K + 127) / 128;
  const int my_chunks = wk < nchunks ? (nchunks - wk + C::WK - 1) / C::WK : 0;

  // Expert-local weight row of local row lr of an item starting at feature/row n0.
  auto wrow = [&](int n0, int lr) {
    if (!C::kGateUp) return n0 + lr;
    return lr < half ? n0 + lr : p.I + n0 + (lr - half);
  };
  auto expert_base = [&](int e) {
    return static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(e) * rows_per_expert * w_row_bytes;
  };

  // Items are (row block, tile) with the tiles of one row block adjacent, assigned statically
  // (item = blockIdx.x + i * gridDim.x): all items move the same weight bytes, so static striding
  // balances as well as a work queue without its latency. Each item's metadata (expert and the
  // tile's padded row list written by moe_align) is loaded one item ahead into registers.
  if (!p.early_prefetch && !p.wait_before_epilogue) pdl_wait();
  const int num_tiles = p.counters[kMoeCntTiles];
  const int num_items = num_tiles * nblocks;
  int item = blockIdx.x;
  int pf_expert = 0, pf_pair = -1;
  if (item < num_items) {
    pf_expert = p.tiles[item % num_tiles].expert;
    if (tid < C::kBT) pf_pair = p.tile_pairs[(item % num_tiles) * C::kBT + tid];
  }
  if (p.early_prefetch) {
    // Everything up to moe_align is complete (see moe_common.cuh): warm L2 with this CTA's first
    // weight block while the previous GEMM finishes, then wait for its output.
    if (item < num_items) {
      const uint8_t* wexp = expert_base(pf_expert);
      const int n0 = (item / num_tiles) * nb_step;
      const int lines = static_cast<int>((w_row_bytes + 127) / 128);
      for (int l = tid; l < C::kRows * lines; l += C::kThreads)
        prefetch_l2(wexp + wrow(n0, l / lines) * w_row_bytes + (l % lines) * 128);
    }
    if (!p.wait_before_epilogue) pdl_wait();
  }
  pdl_trigger();

  uint8_t* ring = smem + wk * C::STAGES * C::kStage;
  for (; item < num_items; item += gridDim.x) {
    const int expert = pf_expert;
    const int n0 = (item / num_tiles) * nb_step;
    if (tid < C::kBT) {
      s_pair[tid] = pf_pair;
      s_xrow[tid] = pf_pair < 0 ? -1 : (C::kGateUp ? pf_pair / p.top_k : pf_pair);
    }
    const int next = item + gridDim.x;
    if (next < num_items) {  // consumed at the next item: the loads fly during this one
      pf_expert = p.tiles[next % num_tiles].expert;
      if (tid < C::kBT) pf_pair = p.tile_pairs[(next % num_tiles) * C::kBT + tid];
    }
    __syncthreads();
    // Warms L2 with the first chunks this warp will stream for the next item (called mid-item,
    // once pf_expert has arrived), so the next item's pipeline starts on L2 hits.
    auto prefetch_next = [&]() {
      if (next >= num_items) return;
      const uint8_t* wn = expert_base(pf_expert);
      const int nn0 = (next / num_tiles) * nb_step;
      const int npf = min(my_chunks, C::STAGES - 1);
      for (int q = lane; q < C::MT * 16 * npf; q += 32) {
        const int r = q / npf, i = q % npf;
        prefetch_l2(wn + wrow(nn0, (wm * C::MT) * 16 + r) * w_row_bytes + (wk + i * C::WK) * C::kChunkBytes);
      }
    };

    // Per-thread source/destination of the cp.async pieces (chunk offset added per chunk).
    const uint8_t* wexp = expert_base(expert);
    const uint8_t* wsrc[C::kWPer];
    int wdst[C::kWPer];
#pragma unroll
    for (int q = 0; q < C::kWPer; ++q) {
      const int qi = gtid + q * C::kGroupThreads, row = qi / C::kWPieces, pc = qi % C::kWPieces;
      wsrc[q] = wexp + wrow(n0, row) * w_row_bytes + pc * 16;
      wdst[q] = row * C::kWRow + pc * 16;
    }
    const uint8_t* xsrc[C::kXPer];  // byte addresses of this thread's token pieces (chunk 0)
    int xdst[C::kXPer];
#pragma unroll
    for (int q = 0; q < C::kXPer; ++q) {
      const int qi = gtid + q * C::kGroupThreads, m = qi / C::kXPieces, pc = qi % C::kXPieces;
      const int64_t row = s_xrow[m];
      if constexpr (C::kA8)
        xsrc[q] = row >= 0 ? p.xq + row * p.ldxq + pc * 16 : nullptr;
      else
        xsrc[q] = row >= 0 ? reinterpret_cast<const uint8_t*>(p.x + row * p.ldx) + pc * 16 : nullptr;
      xdst[q] = C::kXOff + m * C::kXRow + pc * 16;
    }
    // W8A8: thread gtid < BT copies token gtid's scale of the chunk's 128-channel group.
    const float* xs_src = nullptr;
    if constexpr (C::kA8)
      if (gtid < C::kBT && s_xrow[gtid] >= 0) xs_src = p.xs + static_cast<int64_t>(s_xrow[gtid]) * p.ldxs;
    constexpr int kXScaleOff = C::kXOff + C::kBT * C::kXRow;
    // NVFP4: thread gtid < kWScale / 16 copies piece gtid % 4 of m16 tile gtid / 4's group scales.
    const uint8_t* gs_src = nullptr;
    if constexpr (C::kFp4)
      if (gtid < C::kWScale / 16) {
        const int64_t row = static_cast<int64_t>(expert) * rows_per_expert + wrow(n0, (gtid / 4) * 16);
        gs_src = p.w_group_scale + (row / 16) * nchunks * 64 + (gtid % 4) * 16;
      }
    // Scale rows of this warp's m16 tiles (a tile never straddles a 128-row block or gate/up).
    const float* sptr[C::MT];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      const int r = wrow(n0, (wm * C::MT + mt) * 16);
      int srow = r / 128;
      if (C::kGateUp && r >= p.I) srow = sblocks_i + (r - p.I) / 128;
      sptr[mt] = C::kFp8 ? p.w_scale + (static_cast<int64_t>(expert) * scale_rows_per_expert + srow) * scale_cols
                         : nullptr;
    }

    float acc[C::MT][C::NT][4];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    auto issue = [&](int i) {
      const int c = wk + i * C::WK;
      uint8_t* sb = ring + (i % C::STAGES) * C::kStage;
#pragma unroll
      for (int q = 0; q < C::kWPer; ++q) cp_async16(sb + wdst[q], wsrc[q] + c * C::kChunkBytes, true);
      if constexpr (C::kFp4)
        if (gs_src) cp_async16(sb + C::kRows * C::kWRow + gtid * 16, gs_src + c * 64, true);
      constexpr int kXChunkBytes = C::kA8 ? 64 : 128;
      const uint8_t* xbase = C::kA8 ? p.xq : reinterpret_cast<const uint8_t*>(p.x);
#pragma unroll
      for (int q = 0; q < C::kXPer; ++q)
        cp_async16(sb + xdst[q], xsrc[q] ? xsrc[q] + c * kXChunkBytes : xbase, xsrc[q] != nullptr);
      if constexpr (C::kA8)
        if (gtid < C::kBT)
          cp_async4(sb + kXScaleOff + gtid * 4, xs_src ? xs_src + (c >> 1) : p.xs, xs_src != nullptr);
    };

#pragma unroll
    for (int i = 0; i < C::STAGES - 1; ++i) {
      if (i < my_chunks) issue(i);
      cp_async_commit();
    }
    for (int i = 0; i < my_chunks; ++i) {
      cp_async_wait<C::STAGES - 2>();
      group_sync(wk, C::kGroupThreads);
      if (i + C::STAGES - 1 < my_chunks) issue(i + C::STAGES - 1);
      cp_async_commit();
      if (i == my_chunks / 2) prefetch_next();

      const int c = wk + i * C::WK;
      const uint8_t* sb = ring + (i % C::STAGES) * C::kStage;
      float sc[C::MT];
      if constexpr (C::kFp8) {
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) sc[mt] = __ldg(sptr[mt] + (c >> 1));
      }
      // Weight fragments: words per row (fp8: 4 words = 16 k; bf16: 8 words = 16 k; NVFP4: 2).
      constexpr int kWW = C::kFp4 ? 2 : C::kFp8 ? 4 : 8;
      uint32_t wg[C::MT][kWW], wg8[C::MT][kWW];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        const uint8_t* r0 = sb + ((wm * C::MT + mt) * 16 + g) * C::kWRow + c4 * (C::kChunkBytes / 4);
        const uint8_t* r8 = r0 + 8 * C::kWRow;
        if constexpr (C::kFp4) {
          const uint2 a = *reinterpret_cast<const uint2*>(r0);
          const uint2 b = *reinterpret_cast<const uint2*>(r8);
          wg[mt][0] = a.x; wg[mt][1] = a.y;
          wg8[mt][0] = b.x; wg8[mt][1] = b.y;
        }
#pragma unroll
        for (int v = 0; v < kWW / 4; ++v) {
          const uint4 a = *reinterpret_cast<const uint4*>(r0 + v * 16);
          const uint4 b = *reinterpret_cast<const uint4*>(r8 + v * 16);
          wg[mt][4 * v + 0] = a.x; wg[mt][4 * v + 1] = a.y; wg[mt][4 * v + 2] = a.z; wg[mt][4 * v + 3] = a.w;
          wg8[mt][4 * v + 0] = b.x; wg8[mt][4 * v + 1] = b.y; wg8[mt][4 * v + 2] = b.z; wg8[mt][4 * v + 3] = b.w;
        }
      }
      float part[C::MT][C::NT][4];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int i2 = 0; i2 < 4; ++i2) part[mt][nt][i2] = 0.0f;
      if constexpr (C::kA8) {
        // k slots 4c..4c+3 of MMA step s hold real k 16c + 8s + 0..3 and slots 16 + 4c.. real
        // 16c + 8s + 4..7, for the weights and the tokens alike: one 16-byte read per row.
        const float* xsc = reinterpret_cast<const float*>(sb + kXScaleOff);
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          const uint4 xa = *reinterpret_cast<const uint4*>(sb + C::kXOff + (nt * 8 + g) * C::kXRow + c4 * 16);
          const uint32_t xw[4] = {xa.x, xa.y, xa.z, xa.w};
#pragma unroll
          for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
              mma_e4m3_16832(part[mt][nt], wg[mt][2 * s], wg8[mt][2 * s], wg[mt][2 * s + 1], wg8[mt][2 * s + 1],
                             xw[2 * s], xw[2 * s + 1]);
          const float s0 = xsc[nt * 8 + 2 * c4], s1 = xsc[nt * 8 + 2 * c4 + 1];
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) {
            acc[mt][nt][0] = fmaf(part[mt][nt][0], sc[mt] * s0, acc[mt][nt][0]);
            acc[mt][nt][1] = fmaf(part[mt][nt][1], sc[mt] * s1, acc[mt][nt][1]);
            acc[mt][nt][2] = fmaf(part[mt][nt][2], sc[mt] * s0, acc[mt][nt][2]);
            acc[mt][nt][3] = fmaf(part[mt][nt][3], sc[mt] * s1, acc[mt][nt][3]);
          }
        }
      } else if constexpr (C::kFp4) {
        // W4A16: this lane's rows g and g + 8 of each m16 tile as bf16 MMA registers (its 16 k of the
        // chunk are one group), once per chunk for every token column block, times the group scale
        // (exact products; nvfp4_device.cuh).
        const uint8_t* gsm = sb + C::kRows * C::kWRow;
        uint32_t ag[C::MT][8], ag8[C::MT][8];  // rows g, g + 8: register 2 st + h = step st's a0 / a2
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          const uint8_t* t = gsm + (wm * C::MT + mt) * 64 + c4;
          const uint32_t s2 = nvfp4_scales_bf16x2(t[g * 4], t[(g + 8) * 4]);
          nvfp4_group_regs(wg[mt][0], wg[mt][1], bf16x2_dup_lo(s2), ag[mt]);
          nvfp4_group_regs(wg8[mt][0], wg8[mt][1], bf16x2_dup_hi(s2), ag8[mt]);
        }
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          uint32_t xw[8];
          token_frags(sb + C::kXOff + (nt * 8 + g) * C::kXRow + c4 * 32, xw);
#pragma unroll
          for (int st = 0; st < 4; ++st)
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
              mma_bf16_16816(acc[mt][nt], ag[mt][2 * st], ag8[mt][2 * st], ag[mt][2 * st + 1], ag8[mt][2 * st + 1],
                             xw[2 * st], xw[2 * st + 1]);
        }
      } else {
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        uint32_t xw[8];
        token_frags(sb + C::kXOff + (nt * 8 + g) * C::kXRow + c4 * 32, xw);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) {
            uint32_t a0, a1, a2, a3;
            if constexpr (C::kFp8) {
              fp8x4_to_bf16x4(wg[mt][s], a0, a2);
              fp8x4_to_bf16x4(wg8[mt][s], a1, a3);
              mma_bf16_16816(part[mt][nt], a0, a1, a2, a3, xw[2 * s], xw[2 * s + 1]);
            } else {
              a0 = wg[mt][2 * s];
              a2 = wg[mt][2 * s + 1];
              a1 = wg8[mt][2 * s];
              a3 = wg8[mt][2 * s + 1];
              mma_bf16_16816(acc[mt][nt], a0, a1, a2, a3, xw[2 * s], xw[2 * s + 1]);
            }
          }
        }
      }
      if constexpr (C::kFp8) {
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
            for (int i2 = 0; i2 < 4; ++i2) acc[mt][nt][i2] = fmaf(part[mt][nt][i2], sc[mt], acc[mt][nt][i2]);
      }
      }  // W8A16 / bf16
    }
    cp_async_wait<0>();
    if constexpr (C::kFp4) {  // weight_scale_2 * 2^26 of each m16 tile's half (it never straddles one)
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        const int r = wrow(n0, (wm * C::MT + mt) * 16);
        const float gsc = __ldg(p.w_global_scale + (C::kGateUp ? 2 * expert + (r >= p.I ? 1 : 0) : expert));
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= gsc;
      }
    }
    __syncthreads();  // every group is done with its ring: reuse shared memory for the K reduction

    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int lr = (wm * C::MT + mt) * 16 + g, m = nt * 8 + 2 * c4;
        float* r = red + (wk * C::kBT + m) * C::kRedStride + lr;
        r[0] = acc[mt][nt][0];
        r[C::kRedStride] = acc[mt][nt][1];
        r[8] = acc[mt][nt][2];
        r[C::kRedStride + 8] = acc[mt][nt][3];
      }
    __syncthreads();
    if (p.wait_before_epilogue) pdl_wait();  // the predecessor's u (gate_up) / before the first write
    if constexpr (C::kGateUp) {
      for (int idx = tid; idx < half * C::kBT; idx += C::kThreads) {
        const int f = idx % half, m = idx / half;
        if (s_pair[m] < 0) continue;  // tile padding
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int w = 0; w < C::WK; ++w) {
          gs += red[(w * C::kBT + m) * C::kRedStride + f];
          us += red[(w * C::kBT + m) * C::kRedStride + half + f];
        }
        const int64_t pr = s_pair[m];
        if (p.lora_delta) {
          const bf16* d = p.lora_delta + pr * 2 * p.I + n0 + f;
          gs += __bfloat162float(d[0]);
          us += __bfloat162float(d[p.I]);
        } else if (p.lora_gu.token_slot) {
          float dg, du;
          moe_lora_gate_up_delta(p.lora_gu, pr, expert, p.I, n0 + f, dg, du);
          gs += dg;
          us += du;
        }
        p.act[pr * p.I + n0 + f] = __float2bfloat16_rn(gs / (1.0f + expf(-gs)) * us);
      }
    } else {
      for (int idx = tid; idx < C::kRows * C::kBT; idx += C::kThreads) {
        const int r = idx % C::kRows, m = idx / C::kRows;
        if (s_pair[m] < 0) continue;  // tile padding
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < C::WK; ++w) s += red[(w * C::kBT + m) * C::kRedStride + r];
        p.y[static_cast<int64_t>(s_pair[m]) * p.H + n0 + r] = s;
      }
    }
    __syncthreads();  // shared memory and row tables are rewritten by the next item
  }
}

// ---- Variants. STAGES: enough 64-wide chunks in flight per SM to cover HBM latency (bf16 rows
// are twice the bytes, so fewer stages; NVFP4 rows half, so more: S4 keeps about the FP8 variant's
// bytes in flight at a similar shared-memory size; not yet tuned on a GPU). A8: the W8A8 twin of
// the FP8 variant (same tiling).
template <MoeWeightType W, MoeGemmTile T, bool GU, bool A8>
struct Variant;
#define MOE_VARIANT(TILE, MT, NT, WM, WK, S8, S16, S4)                                    \
  template <bool GU>                                                                    \
  struct Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, GU, false> {                   \
    using C = Cfg<MoeWeightType::kFp8, MT, NT, WM, WK, S8, GU>;                         \
  };                                                                                    \
  template <bool GU>                                                                    \
  struct Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, GU, true> {                    \
    using C = Cfg<MoeWeightType::kFp8, MT, NT, WM, WK, S8, GU, true>;                   \
  };                                                                                    \
  template <bool GU>                                                                    \
  struct Variant<MoeWeightType::kBf16, MoeGemmTile::TILE, GU, false> {                  \
    using C = Cfg<MoeWeightType::kBf16, MT, NT, WM, WK, S16, GU>;                       \
  };                                                                                    \
  template <bool GU>                                                                    \
  struct Variant<MoeWeightType::kNvfp4, MoeGemmTile::TILE, GU, false> {                 \
    using C = Cfg<MoeWeightType::kNvfp4, MT, NT, WM, WK, S4, GU>;                       \
  };
// Decode: 4 stages (3 chunks ahead per warp) keep 4 CTAs of the 8-row tile on an SM, whose
// pipelines cover each other's item boundaries.
MOE_VARIANT(kDecode8, 2, 1, 1, 4, 4, 3, 6)
MOE_VARIANT(kDecode16, 2, 2, 1, 4, 4, 3, 5)
MOE_VARIANT(kDecode32, 2, 4, 1, 4, 3, 3, 4)
MOE_VARIANT(kPrefill64, 2, 8, 4, 1, 4, 3, 4)
#undef MOE_VARIANT

struct KernelInfo {
  int occupancy = 0;  // CTAs per SM
};

template <class C>
KernelInfo make_kernel_info() {
  KernelInfo k;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  MOELORA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k.occupancy, moe_gemm_kernel<C>, C::kThreads, C::kSmem));
  MOELORA_CHECK(k.occupancy >= 1);
  return k;
}

template <class C>
const KernelInfo& kernel_info() {
  static const KernelInfo info = make_kernel_info<C>();
  return info;
}

template <class C>
void launch_variant(const MoeGemmParams& p, cudaStream_t stream) {
  const KernelInfo& info = kernel_info<C>();
  const int nb = C::kGateUp ? p.I / (C::kRows / 2) : p.H / C::kRows;
  MOELORA_CHECK((C::kGateUp ? p.I % (C::kRows / 2) : p.H % C::kRows) == 0);  // tile must divide the output
  const int64_t max_items = static_cast<int64_t>(p.max_tiles) * nb;
  const int grid = static_cast<int>(std::min<int64_t>(max_items, static_cast<int64_t>(moe_num_sms()) * info.occupancy));
  if (grid <= 0) return;
  moe_launch(moe_gemm_kernel<C>, dim3(grid), dim3(C::kThreads), C::kSmem, stream, p.pdl, p);
}

template <bool GU>
void dispatch(const MoeGemmParams& p, cudaStream_t stream) {
  const bool f8 = p.wtype == MoeWeightType::kFp8, f4 = p.wtype == MoeWeightType::kNvfp4;
  const int K = GU ? p.H : p.I;
  MOELORA_CHECK(p.H % 64 == 0 && p.I % 64 == 0 && p.E >= 1 && p.w && p.tile_pairs && p.tiles && p.counters);
  MOELORA_CHECK(!p.act_fp8 || f8);  // W8A8 needs FP8 weights
  if (p.act_fp8)  // 16-byte e4m3 rows for cp.async, one scale per 128-channel group
    MOELORA_CHECK(p.xq && p.xs && p.ldxq % 16 == 0 && p.ldxq >= K && p.ldxs >= (K + 127) / 128);
  else
    MOELORA_CHECK(p.x && p.ldx % 8 == 0);  // 16-byte activation rows for cp.async
  MOELORA_CHECK(p.align_tile_rows == moe_gemm_tile_rows(p.tile));  // tile_pairs is [tiles, rows]
  MOELORA_CHECK(p.wtype == MoeWeightType::kBf16 || p.w_scale || f4);
  MOELORA_CHECK(!f4 || (p.w_group_scale && p.w_global_scale && (reinterpret_cast<uintptr_t>(p.w_group_scale) & 15) == 0));
  MOELORA_CHECK(GU ? (p.act && p.top_k >= 1) : (p.y != nullptr));
  MOELORA_CHECK(!GU || !p.early_prefetch);
  switch (p.tile) {
#define MOE_CASE(TILE)                                                                             \
  case MoeGemmTile::TILE:                                                                          \
    if (f8 && p.act_fp8)                                                                           \
      launch_variant<typename Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, GU, true>::C>(p, stream);  \
    else if (f8)                                                                                   \
      launch_variant<typename Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, GU, false>::C>(p, stream); \
    else if (f4)                                                                                   \
      launch_variant<typename Variant<MoeWeightType::kNvfp4, MoeGemmTile::TILE, GU, false>::C>(p, stream); \
    else                                                                                           \
      launch_variant<typename Variant<MoeWeightType::kBf16, MoeGemmTile::TILE, GU, false>::C>(p, stream); \
    break;
    MOE_CASE(kDecode8)
    MOE_CASE(kDecode16)
    MOE_CASE(kDecode32)
    MOE_CASE(kPrefill64)
#undef MOE_CASE
  }
}

// ---- Weighted sum over k (deterministic: fixed order, no atomics).
constexpr int kReduceThreads = 256;
// With the down LoRA expand inside (MoeLoraDown): each thread also reads k rows of B per column,
// so it takes 2 columns instead of 4 and the blocks are smaller: at one token (H = 2048) 16
// blocks stream the pairs' B instead of 2.
constexpr int kReduceLoraThreads = 64;

template <int COLS>
__device__ __forceinline__ void load_cols(const float* p, float (&v)[COLS]) {
  if constexpr (COLS == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const float2 f = *reinterpret_cast<const float2*>(p);
    v[0] = f.x, v[1] = f.y;
  }
}

// COLS consecutive columns per thread; the sum over j runs in the same order for every COLS, so
// the bits do not depend on the variant.
template <int COLS, bool LORA_IN>
__global__ void __launch_bounds__(LORA_IN ? kReduceLoraThreads : kReduceThreads) moe_reduce_kernel(const __grid_constant__ MoeReduceParams p) {
  pdl_wait();
  pdl_trigger();
  const int HC = p.H / COLS;
  const int64_t total = static_cast<int64_t>(p.T) * HC;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(idx / HC), h = static_cast<int>(idx % HC) * COLS;
    float a[COLS];
#pragma unroll
    for (int i = 0; i < COLS; ++i) a[i] = 0.0f;
    for (int j = 0; j < p.k; ++j) {
      const int64_t pr = static_cast<int64_t>(t) * p.k + j;
      const int e = p.ids[pr];
      if (e < 0 || e >= p.E) continue;
      const float w = p.weights[pr];
      float v[COLS];
      load_cols<COLS>(p.y + pr * p.H + h, v);
      if constexpr (LORA_IN) {
        const MoeLoraPairB pb = moe_lora_down_b(p.lora_d, pr, p.k, e);  // once per pair, not per column
        const float* u = p.lora_d.u + pr * p.lora_d.ldu;
#pragma unroll
        for (int i = 0; i < COLS; ++i) v[i] += moe_lora_delta(pb, u, h + i);
      } else if (p.lora_delta) {
#pragma unroll
        for (int i = 0; i < COLS; i += 2) {
          const uint32_t d = *reinterpret_cast<const uint32_t*>(p.lora_delta + pr * p.H + h + i);
          v[i] += bf16_lo(d);
          v[i + 1] += bf16_hi(d);
        }
      }
#pragma unroll
      for (int i = 0; i < COLS; ++i) a[i] = fmaf(w, v[i], a[i]);
    }
    bf16* o = p.out + static_cast<int64_t>(t) * p.ldo + h;
    if constexpr (COLS == 4) {
      uint2 ov;
      ov.x = pack_bf16x2(a[0], a[1]);
      ov.y = pack_bf16x2(a[2], a[3]);
      *reinterpret_cast<uint2*>(o) = ov;
    } else {
      *reinterpret_cast<uint32_t*>(o) = pack_bf16x2(a[0], a[1]);
    }
  }
}

}  // namespace

void moe_gate_up(const MoeGemmParams& p, cudaStream_t stream) {
  if (p.generic)
    moe_gate_up_generic(p, stream);
  else if (p.wgmma)
    moe_gate_up_wgmma(p, stream);
  else
    dispatch<true>(p, stream);
}
void moe_down(const MoeGemmParams& p, cudaStream_t stream) {
  if (p.generic)
    moe_down_generic(p, stream);
  else if (p.wgmma)
    moe_down_wgmma(p, stream);
  else
    dispatch<false>(p, stream);
}

void moe_reduce(const MoeReduceParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.H % 4 == 0 && p.ldo % 4 == 0 && p.k >= 1 && p.y && p.ids && p.weights && p.out);
  MOELORA_CHECK((reinterpret_cast<uintptr_t>(p.out) & 7) == 0);
  const bool lora_in = p.lora_d.token_slot != nullptr;
  MOELORA_CHECK(!lora_in || (!p.lora_delta && p.lora_d.u && p.lora_d.b.ptr && p.lora_d.b.stride && p.lora_d.b.rank));
  if (p.T == 0) return;
  if (lora_in) {
    const int64_t total = static_cast<int64_t>(p.T) * (p.H / 2);
    const int grid = static_cast<int>(
        std::min<int64_t>((total + kReduceLoraThreads - 1) / kReduceLoraThreads, moe_num_sms() * 32));
    moe_launch(moe_reduce_kernel<2, true>, dim3(grid), dim3(kReduceLoraThreads), 0, stream, p.pdl, p);
    return;
  }
  const int64_t total = static_cast<int64_t>(p.T) * (p.H / 4);
  const int grid = static_cast<int>(std::min<int64_t>((total + kReduceThreads - 1) / kReduceThreads, moe_num_sms() * 8));
  moe_launch(moe_reduce_kernel<4, false>, dim3(grid), dim3(kReduceThreads), 0, stream, p.pdl, p);
}

static void init_all_variants() {
#define MOE_INIT(TILE)                                                             \
  kernel_info<Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, true, false>::C>();  \
  kernel_info<Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, false, false>::C>(); \
  kernel_info<Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, true, true>::C>();   \
  kernel_info<Variant<MoeWeightType::kFp8, MoeGemmTile::TILE, false, true>::C>();  \
  kernel_info<Variant<MoeWeightType::kBf16, MoeGemmTile::TILE, true, false>::C>(); \
  kernel_info<Variant<MoeWeightType::kBf16, MoeGemmTile::TILE, false, false>::C>(); \
  kernel_info<Variant<MoeWeightType::kNvfp4, MoeGemmTile::TILE, true, false>::C>(); \
  kernel_info<Variant<MoeWeightType::kNvfp4, MoeGemmTile::TILE, false, false>::C>();
  MOE_INIT(kDecode8)
  MOE_INIT(kDecode16)
  MOE_INIT(kDecode32)
  MOE_INIT(kPrefill64)
#undef MOE_INIT
  moe_gemm_wgmma_init();
}

void moe_gemm_init() {
  static std::once_flag once;
  std::call_once(once, init_all_variants);
}

}  // namespace moelora::cuda
