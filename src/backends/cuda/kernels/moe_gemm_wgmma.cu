// Grouped expert GEMMs on Hopper's asynchronous machinery (sm_90a): FP8 weights streamed by the
// tensor-memory accelerator (TMA) into a shared-memory ring, bf16 tensor-core MMAs issued by a
// warpgroup (wgmma), a producer warp that runs ahead across work items. Same math, layouts and
// work items as moe_gemm.cu's W8A16 path (see moe_gemm.cuh), chosen on the host
// (cuda_plan::choose_moe_tuning, MoeTuning::wgmma).
//
// Why: the mma.sync kernels measured latency-bound on the H200 (ncu at 256 tokens: 32 % of DRAM
// bandwidth, the integer pipe busiest with per-thread cp.async address math, each item's pipeline
// filled and drained on its own). Here one thread issues a whole 64 x 128 weight tile per stage,
// and the ring runs continuously from one item to the next, so the bytes in flight per SM never
// drop to zero at item boundaries.
//
// CTA = two consumer warpgroups (warps 0-7) + one producer warp (warp 8).
//  - Work item = (token tile of BN rows of one expert) x (128 weight rows): down rows n0..n0+127
//    of H (warpgroup w takes rows 64w..64w+63); gate_up the 64 gate rows f0..f0+63 (warpgroup 0)
//    and the 64 up rows of the same features (warpgroup 1), so SwiGLU happens in the epilogue.
//    Both warpgroups read the same token tile: half the token bytes per weight byte of a 64-row
//    item (the first version, with one warpgroup, measured slower than mma.sync at every batch).
//    Items are strided over a persistent grid as in moe_gemm.cu.
//  - Stage = one 128-wide K chunk (= one FP8 scale block): A = 128 x 128 FP8 bytes by TMA (one
//    box, or a gate and an up box of 64 rows), B = the tile's BN token rows x 128 bf16 gathered by
//    the producer's lanes with cp.async (rows come from the tile's pair list; padding rows are
//    zero-filled), written in the 128-byte swizzle that the wgmma descriptor reads.
//  - The consumer dequantises its A fragments exactly to bf16 in registers (e4m3 -> bf16 is exact),
//    each k16 step right before its wgmma (so decoding overlaps the previous step's MMA), 8 steps
//    into a fresh f32 partial, then adds partial x block scale to the f32 accumulator: the same
//    per-block f32 scaling as the CPU reference (docs/numerics.md).
//  - Synchronisation: full[s] completes when the weight TMA's bytes have landed (expect_tx) and
//    each producer lane's cp.async copies have completed (`cp.async.mbarrier.arrive.noinc`: the
//    producer never waits for its own copies); the consumer then fences the generic-proxy writes
//    of the token rows for wgmma's async-proxy reads. empty[s] completes when the 8 consumer warps
//    are done with the stage.
//  - NVFP4 experts (kW4Bf16, W4A16): a stage's weights are 128 rows x 64 bytes of packed e2m1 codes
//    plus the rows' e4m3 group scales (9 KB instead of 16), both by TMA without swizzle; each
//    consumer lane reads its rows' 16-byte code runs and decodes register c of each group's code
//    words (k 2c, 2c + 1 and 2c + 8, 2c + 9: one group per k16 step) with a byte permutation and
//    one exact bf16 multiply by the group scale (nvfp4_device.cuh), so the packed layout is the
//    one moe_gemm.cu's 4-bit kernels read (one upload serves both). The wgmmas accumulate across
//    chunks; the global scale multiplies the sums in the epilogue.
//  - History (bench/RESULTS.md, 2026-12-04): a producer that waited for each stage's token rows
//    before publishing it ran one L2 round trip per stage behind; one TMA box per token row made
//    32- and 64-row tiles 2-3x slower (64 tiny boxes per stage); 9 warps at over 96 registers or the
//    default shared-memory carveout left one CTA per SM.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_gemm.cuh"
#include "backends/cuda/kernels/nvfp4_device.cuh"
#include "backends/cuda/kernels/wgmma.cuh"

namespace moelora::cuda {
namespace {

using namespace moe_detail;
using namespace sm90;

constexpr int kRowsPerItem = 128;  // weight rows per item: two m64 wgmmas, one per warpgroup
constexpr int kKChunk = 128;       // K per stage (FP8 bytes): one 128 x 128 scale block column
constexpr int kConsumerWarps = 8;  // two warpgroups
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;
constexpr int kA8Bytes = kRowsPerItem * kKChunk;  // FP8 weight tile of a stage
// NVFP4 weight tile of a stage: 128 rows x 64 bytes of packed codes (cuda_plan/nvfp4_layout.h's
// order), then the rows' e4m3 group scales as the layout stores them, [8 row tiles][2][16][4].
constexpr int kA4CodeBytes = kRowsPerItem * kKChunk / 2;
constexpr int kA4ScaleBytes = kRowsPerItem * (kKChunk / 16);
constexpr int kA4Bytes = kA4CodeBytes + kA4ScaleBytes;

// How the token rows reach the tensor cores (MoeGemmParams: act_fp8, xq_lo).
enum ActMode : int {
  kActBf16 = 0,   // bf16 rows; the weights are dequantised to bf16 in registers (W8A16)
  kActFp8 = 1,    // e4m3 rows + per-(row, 128) scales, e4m3 x e4m3 wgmma from shared memory (W8A8)
  kActSplit = 2,  // two e4m3 terms per value (fp8_quant's split form: bf16 to within 2^-17 of the
                  // group's amax), two e4m3 x e4m3 wgmmas per step: W8A16 without any dequantising
  kW4Bf16 = 3,    // NVFP4 weights (W4A16): bf16 rows as kActBf16; the 4-bit codes and their group
                  // scales come by TMA and are decoded exactly to bf16 in registers (nvfp4_device.cuh)
};

template <int BN, int MODE>
struct WgCfg {
  static_assert(BN == 8 || BN == 16 || BN == 32 || BN == 64, "wgmma n of the token tile");
  static constexpr bool kW4 = MODE == kW4Bf16;
  static constexpr int kABytes = kW4 ? kA4Bytes : kA8Bytes;
  // bf16: two 64-wide swizzle columns; e4m3: one 128-byte column per term.
  static constexpr int kBBytes = MODE == kActFp8 ? BN * kKChunk : BN * kKChunk * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // <= ~112 KB per CTA, so two CTAs share an SM (four warpgroups computing, 6-10 stages in
  // flight); the 64-row tile (prefill) takes one CTA per SM with 3 stages. The 4-bit stages are
  // smaller (9 KB of weights instead of 16): more of them in the same bytes.
  static constexpr int kStages = kW4 ? (BN == 8 ? 8 : BN == 16 ? 6 : BN == 32 ? 5 : 3) : (BN == 8 ? 5 : BN == 16 ? 4 : 3);
  static constexpr int kEpiStride = kRowsPerItem + 4;  // floats per token row: conflict-free stores
  static constexpr int kEpiBytes = BN * kEpiStride * 4;
  static constexpr int kBarBytes = 2 * kStages * 8;
  static constexpr int kScaleBytes = MODE == kActBf16 || kW4 ? 0 : kStages * BN * 4;  // token scales per stage
  // 1024 bytes of slack to align the ring to the 128-byte swizzle's 1024-byte atom.
  static constexpr int kSmem = 1024 + kStages * kStageBytes + kEpiBytes + kBarBytes + kScaleBytes;
  static_assert(kStageBytes % 1024 == 0 && kABytes % 1024 == 0, "stages and token tiles keep the swizzle atoms aligned");
};

// ---- mbarrier, TMA, wgmma (PTX).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Arrives on `bar` when every cp.async this thread issued before has completed (no wait here;
// .noinc: the arrival counts against the count the barrier was initialised with).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// One 2-D box of `map` at (x = K byte offset, y = row) into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}

// D(64 x BN, f32) (+)= A(64 x 32, e4m3, shared memory) * B(32 x BN, e4m3, shared memory), both
// K-major in the 128-byte swizzle. Hopper's FP8 MMA keeps fewer than f32's bits in its running sum
// (DeepGEMM's notes: about 14), so callers add each 128-wide K chunk's partial into an f32
// accumulator of their own, as the block scales require anyway.
template <int BN>
struct WgmmaF8;
template <>
struct WgmmaF8<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(accumulate));
  }
};
template <>
struct WgmmaF8<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(accumulate));
  }
};
template <>
struct WgmmaF8<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "%16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate));
  }
};
template <>
struct WgmmaF8<64> {
  __device__ __forceinline__ static void mma(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
  }
};

__device__ __forceinline__ void cp_async4(void* smem, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(src), "r"(pred ? 4 : 0)
               : "memory");
}

struct WgmmaParams {
  // FP8 weights [E * rows_per_expert, K] bytes, box 128 x (128 down | 64 gate_up), 128-byte swizzle;
  // NVFP4 codes [E * rows_per_expert, K / 2] bytes, box 64 x (128 | 64), no swizzle.
  CUtensorMap w_map;
  // NVFP4 only: the group scales as [E * rows_per_expert / 16 row tiles, K] bytes, box 128 x (8 | 4).
  CUtensorMap s_map;
  MoeGemmParams g;
};

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

template <int BN, bool GATE_UP, int MODE>
// At most 96 registers: two CTAs of 9 warps per SM, whose busiest SM sub-partition holds 5 warps
// of its 16384 registers (ncu: 102 registers left room for one CTA only).
__global__ void __maxnreg__(BN == 64 ? 168 : 96) moe_gemm_wgmma_kernel(const __grid_constant__ WgmmaParams wp) {
  using C = WgCfg<BN, MODE>;
  const MoeGemmParams& p = wp.g;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* epi = reinterpret_cast<float*>(ring + C::kStages * C::kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + C::kStages * C::kStageBytes + C::kEpiBytes);
  uint64_t* empty = full + C::kStages;
  float* xscale = reinterpret_cast<float*>(empty + C::kStages);  // [stage][BN] (FP8 modes)

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int K = GATE_UP ? p.H : p.I;
  const int nchunks = K / kKChunk;
  const int nblocks = GATE_UP ? p.I / (kRowsPerItem / 2) : p.H / kRowsPerItem;

  if (tid == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&full[s], 1 + 32);           // the weight TMA's expect_tx + 32 producer lanes' cp.async
      mbar_init(&empty[s], kConsumerWarps);  // each consumer warp once done with the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The tiles (moe_align) and, for down, act (moe_gate_up) come from predecessors; with
  // wait_before_epilogue from kernels before the one this waits for (see moe_gemm.cuh).
  if (!p.wait_before_epilogue) pdl_wait();
  pdl_trigger();
  const int num_tiles = p.counters[kMoeCntTiles];
  const int num_items = num_tiles * nblocks;

  if (warp == kConsumerWarps) {
    // ---- Producer warp: weight tiles by TMA (one lane), the tile's token rows by cp.async (all lanes).
    if (lane == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wp.w_map)) : "memory");
    if constexpr (C::kW4)  // the group scales' map, read by the first stage too
      if (lane == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wp.s_map)) : "memory");
    const int rows_per_expert = GATE_UP ? 2 * p.I : p.H;
    int stage = 0;
    uint32_t phase = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const int tile = item % num_tiles, blk = item / num_tiles;
      const int expert = p.tiles[tile].expert;
      const int row0 = expert * rows_per_expert + blk * (GATE_UP ? kRowsPerItem / 2 : kRowsPerItem);
      // x rows of token rows `lane` and `lane + 32` of the tile (-1: padding, zero-filled).
      int xr[2] = {-1, -1};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = lane + 32 * h;
        if (r < BN) {
          const int pair = p.tile_pairs[tile * BN + r];
          xr[h] = pair < 0 ? -1 : (GATE_UP ? pair / p.top_k : pair);
        }
      }
      for (int c = 0; c < nchunks; ++c) {
        mbar_wait(&empty[stage], phase ^ 1);
        uint8_t* a_dst = ring + stage * C::kStageBytes;
        uint8_t* b_dst = a_dst + C::kABytes;
        if (C::kW4 && lane == 0) {
          // Codes (64 bytes of a row per 128-wide K chunk) and the rows' group scales (the 128
          // bytes of chunk c in each 16-row tile): rows 0..63 gate and 64..127 up, or 128 down rows.
          mbar_arrive_expect_tx(&full[stage], C::kABytes);
          uint8_t* s_dst = a_dst + kA4CodeBytes;
          if (GATE_UP) {
            tma_load_2d(a_dst, &wp.w_map, c * (kKChunk / 2), row0, &full[stage]);
            tma_load_2d(a_dst + kA4CodeBytes / 2, &wp.w_map, c * (kKChunk / 2), row0 + p.I, &full[stage]);
            tma_load_2d(s_dst, &wp.s_map, c * kKChunk, row0 / 16, &full[stage]);
            tma_load_2d(s_dst + kA4ScaleBytes / 2, &wp.s_map, c * kKChunk, (row0 + p.I) / 16, &full[stage]);
          } else {
            tma_load_2d(a_dst, &wp.w_map, c * (kKChunk / 2), row0, &full[stage]);
            tma_load_2d(s_dst, &wp.s_map, c * kKChunk, row0 / 16, &full[stage]);
          }
        } else if (lane == 0) {
          mbar_arrive_expect_tx(&full[stage], C::kABytes);
          if (GATE_UP) {
            tma_load_2d(a_dst, &wp.w_map, c * kKChunk, row0, &full[stage]);                    // gate rows
            tma_load_2d(a_dst + C::kABytes / 2, &wp.w_map, c * kKChunk, row0 + p.I, &full[stage]);  // up rows
          } else {
            tma_load_2d(a_dst, &wp.w_map, c * kKChunk, row0, &full[stage]);
          }
        }
        if constexpr (MODE == kActBf16 || C::kW4) {
          // Token tile: BN rows x 16 pieces of 16 bytes (128 bf16); piece q of row r goes to swizzle
          // column q / 8 at row r, 16-byte unit (q % 8) ^ (r % 8) (the 128-byte swizzle's rule).
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) {
            const int idx = lane + 32 * i, r = idx >> 4, q = idx & 15;
            const int xrow = __shfl_sync(0xffffffffu, xr[(2 * i) >> 5], r & 31);  // r / 32 == 2i / 32
            uint8_t* dst = b_dst + (q >> 3) * (BN * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4);
            const bf16* src = xrow >= 0 ? p.x + static_cast<int64_t>(xrow) * p.ldx + c * kKChunk + q * 8 : p.x;
            cp_async16(dst, src, xrow >= 0);
          }
        } else {
          // e4m3 rows: BN rows x 8 pieces of 16 bytes per term, same swizzle; the split form's low
          // term is a second tile right after the first. Then the rows' scales of this K chunk.
#pragma unroll
          for (int i = 0; i < BN / 4; ++i) {
            const int idx = lane + 32 * i, r = idx >> 3, q = idx & 7;
            const int xrow = __shfl_sync(0xffffffffu, xr[(4 * i) >> 5], r & 31);  // r / 32 == 4i / 32
            const int off = r * 128 + ((q ^ (r & 7)) << 4);
            const int64_t src = xrow >= 0 ? static_cast<int64_t>(xrow) * p.ldxq + c * kKChunk + q * 16 : 0;
            cp_async16(b_dst + off, p.xq + src, xrow >= 0);
            if constexpr (MODE == kActSplit) cp_async16(b_dst + BN * 128 + off, p.xq_lo + src, xrow >= 0);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = lane + 32 * h;
            if (r < BN)
              cp_async4(xscale + stage * BN + r, p.xs + (xr[h] >= 0 ? static_cast<int64_t>(xr[h]) * p.ldxs + c : 0),
                        xr[h] >= 0);
          }
        }
        cp_async_mbar_arrive(&full[stage]);  // arrives once this lane's copies have landed
        if (++stage == C::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  // ---- Consumer warpgroups (warpgroup w = warps 4w..4w+3 owns A rows 64w..64w+63).
  const int g = lane >> 2, c4 = lane & 3;
  const int r0 = warp * 16 + g;  // this thread's A rows r0 and r0 + 8 of the item
  const int sblocks_i = (p.I + 127) / 128;
  const int scale_rows_per_expert = GATE_UP ? 2 * sblocks_i : (p.H + 127) / 128;
  const int scale_cols = K / 128;
  const uint32_t sel = (c4 & 1) ? 0x7632u : 0x5410u;  // bytes k = 2c, 2c+1 of two words
  const int shift4 = cuda_plan::nvfp4_pair_shift(c4);  // NVFP4: this lane's register of a code word
  int stage = 0;
  uint32_t phase = 0;
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const int tile = item % num_tiles, blk = item / num_tiles;
    const int expert = p.tiles[tile].expert;
    // Scale row of this warp's 16 rows (gate_up: warpgroup 0 gate, 1 up).
    int srow;
    if (GATE_UP) {
      const int f0 = blk * (kRowsPerItem / 2);
      srow = (warp < 4 ? 0 : sblocks_i) + f0 / 128;
    } else {
      srow = blk * kRowsPerItem / 128;
    }
    // FP8 block scales (NVFP4 carries its group scales in the stage and has no block scales).
    const float* sptr =
        C::kW4 ? nullptr : p.w_scale + (static_cast<int64_t>(expert) * scale_rows_per_expert + srow) * scale_cols;

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    float sc_next = C::kW4 ? 1.0f : __ldg(sptr);
    for (int c = 0; c < nchunks; ++c) {
      const float sc = sc_next;
      if (!C::kW4 && c + 1 < nchunks) sc_next = __ldg(sptr + c + 1);
      mbar_wait(&full[stage], phase);
      // The token rows were written by cp.async (generic proxy) and wgmma reads them through the
      // async proxy: order the two (the weight bytes came by TMA, already in the async proxy).
      fence_proxy_async_shared();
      const uint8_t* a_s = ring + stage * C::kStageBytes;
      const uint32_t b_s = smem_u32(a_s + C::kABytes);
      if constexpr (C::kW4) {
        // This lane's rows r0 and r0 + 8: 16 bytes of codes per pair of k16 steps (one NVFP4 group
        // per step: groups 2u, 2u + 1) and the rows' 8 group scales of the chunk (row tile `warp`,
        // rows g and g + 8). Lane c needs register c of each group's two code words (k 2c, 2c + 1
        // and 2c + 8, 2c + 9), times the group scale: the exact products of nvfp4_device.cuh. Each
        // step is decoded right before its wgmma, which accumulates across chunks (no block scale;
        // the global scale multiplies the sums in the epilogue, as in moe_gemm.cu).
        using cuda_plan::nvfp4_chunk128_scale_byte;
        const uint8_t* codes = a_s + r0 * (kKChunk / 2);
        const uint8_t* tile_s = a_s + kA4CodeBytes + warp * 128;  // row tile r0 / 16 == warp
        auto scale_word = [&](int row, int s0) {  // groups s0 .. s0 + 3 of a row, byte i = group s0 + i
          return *reinterpret_cast<const uint32_t*>(tile_s + nvfp4_chunk128_scale_byte(row, s0));
        };
        const uint32_t sg[2] = {scale_word(g, 0), scale_word(g, 4)};
        const uint32_t sg8[2] = {scale_word(g + 8, 0), scale_word(g + 8, 4)};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint4 q0 = *reinterpret_cast<const uint4*>(codes + 16 * u);
          const uint4 q8 = *reinterpret_cast<const uint4*>(codes + 8 * (kKChunk / 2) + 16 * u);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int s = 2 * u + h;
            const uint32_t s2 = nvfp4_scales_bf16x2((sg[s >> 2] >> (8 * (s & 3))) & 0xffu, (sg8[s >> 2] >> (8 * (s & 3))) & 0xffu);
            const uint32_t s_g = bf16x2_dup_lo(s2), s_g8 = bf16x2_dup_hi(s2);
            uint32_t afr[4];
            afr[0] = nvfp4_bf16x2_mul(nvfp4_pair_at(h ? q0.z : q0.x, shift4), s_g);   // row g: k 2c, 2c+1
            afr[2] = nvfp4_bf16x2_mul(nvfp4_pair_at(h ? q0.w : q0.y, shift4), s_g);   // row g: k 2c+8, 2c+9
            afr[1] = nvfp4_bf16x2_mul(nvfp4_pair_at(h ? q8.z : q8.x, shift4), s_g8);  // row g + 8
            afr[3] = nvfp4_bf16x2_mul(nvfp4_pair_at(h ? q8.w : q8.y, shift4), s_g8);
            wgmma_fence();
            Wgmma<BN>::mma(acc, afr, desc_sw128(b_s + (s >> 2) * (BN * 128) + (s & 3) * 32), c > 0 || s > 0);
          }
        }
        wgmma_commit();
        wgmma_wait0();
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);
      } else if constexpr (MODE != kActBf16) {
        // Both operands from shared memory: this warpgroup's 64 weight rows and the token tile
        // (and its low term), 4 k32 steps each; no register work per weight byte.
        const uint32_t a_w = smem_u32(a_s) + (warp >> 2) * (64 * 128);
        float part[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) part[i] = 0.0f;
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) WgmmaF8<BN>::mma(part, desc_sw128(a_w + 32 * s), desc_sw128(b_s + 32 * s), s > 0);
        if constexpr (MODE == kActSplit) {
#pragma unroll
          for (int s = 0; s < 4; ++s)
            WgmmaF8<BN>::mma(part, desc_sw128(a_w + 32 * s), desc_sw128(b_s + BN * 128 + 32 * s), 1);
        }
        wgmma_commit();
        wgmma_wait0();
        // Column n of the partial is token row n of the tile: its scale for this K chunk.
        float xsc[BN / 8][2];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          xsc[j][0] = xscale[stage * BN + 8 * j + 2 * c4] * sc;
          xsc[j][1] = xscale[stage * BN + 8 * j + 2 * c4 + 1] * sc;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          acc[4 * j + 0] = fmaf(part[4 * j + 0], xsc[j][0], acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(part[4 * j + 1], xsc[j][1], acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(part[4 * j + 2], xsc[j][0], acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(part[4 * j + 3], xsc[j][1], acc[4 * j + 3]);
        }
      } else {
        // A fragments, dequantised exactly: row r's 16-byte unit s sits at unit
        // s ^ (r % 8) (r0 and r0 + 8 share r % 8 = g).
        // Each k16 step's A fragment is decoded right before its wgmma is issued, so decoding step
        // s + 1 overlaps step s on the tensor cores (run 3 decoded all 8 first, then issued).
        float part[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) part[i] = 0.0f;  // overwritten (first step: accumulate = 0)
        const int wsel = c4 >> 1;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int unit = (s ^ g) << 4;
          const uint32_t* q0 = reinterpret_cast<const uint32_t*>(a_s + r0 * 128 + unit);
          const uint32_t* q8 = reinterpret_cast<const uint32_t*>(a_s + (r0 + 8) * 128 + unit);
          uint32_t afr[4];
          fp8x4_to_bf16x4(__byte_perm(q0[wsel], q0[2 + wsel], sel), afr[0], afr[2]);  // row g: k 2c, 2c+1 | 2c+8, 2c+9
          fp8x4_to_bf16x4(__byte_perm(q8[wsel], q8[2 + wsel], sel), afr[1], afr[3]);  // row g + 8
          wgmma_fence();
          Wgmma<BN>::mma(part, afr, desc_sw128(b_s + (s >> 2) * (BN * 128) + (s & 3) * 32), s > 0);
        }
        wgmma_commit();
        wgmma_wait0();
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[stage]);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = fmaf(part[i], sc, acc[i]);
      }
      if (++stage == C::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }

    if constexpr (C::kW4) {  // weight_scale_2 * 2^26 of this warpgroup's half (gate_up) or the expert (down)
      const float gsc = __ldg(p.w_global_scale + (GATE_UP ? 2 * expert + (warp >= 4 ? 1 : 0) : expert));
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] *= gsc;
    }
    // ---- Epilogue through shared memory: epi[token][row].
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int n = 8 * j + 2 * c4;
      epi[n * C::kEpiStride + r0] = acc[4 * j + 0];
      epi[(n + 1) * C::kEpiStride + r0] = acc[4 * j + 1];
      epi[n * C::kEpiStride + r0 + 8] = acc[4 * j + 2];
      epi[(n + 1) * C::kEpiStride + r0 + 8] = acc[4 * j + 3];
    }
    consumers_sync();
    if (p.wait_before_epilogue) pdl_wait();  // the predecessor's u (gate_up) / before the first write
    const int32_t* pairs = p.tile_pairs + tile * BN;
    if (GATE_UP) {
      const int f0 = blk * (kRowsPerItem / 2);
      for (int idx = tid; idx < BN * 64; idx += kConsumers) {
        const int f = idx & 63, m = idx >> 6;
        const int pr = pairs[m];
        if (pr < 0) continue;  // tile padding
        float gs = epi[m * C::kEpiStride + f], us = epi[m * C::kEpiStride + 64 + f];
        if (p.lora_delta) {
          const bf16* d = p.lora_delta + static_cast<int64_t>(pr) * 2 * p.I + f0 + f;
          gs += __bfloat162float(d[0]);
          us += __bfloat162float(d[p.I]);
        } else if (p.lora_gu.token_slot) {
          float dg, du;
          moe_lora_gate_up_delta(p.lora_gu, pr, expert, p.I, f0 + f, dg, du);
          gs += dg;
          us += du;
        }
        p.act[static_cast<int64_t>(pr) * p.I + f0 + f] = __float2bfloat16_rn(gs / (1.0f + expf(-gs)) * us);
      }
    } else {
      const int n0 = blk * kRowsPerItem;
      for (int idx = tid; idx < BN * kRowsPerItem; idx += kConsumers) {
        const int r = idx & 127, m = idx >> 7;
        const int pr = pairs[m];
        if (pr < 0) continue;
        p.y[static_cast<int64_t>(pr) * p.H + n0 + r] = epi[m * C::kEpiStride + r];
      }
    }
    consumers_sync();  // epi is rewritten by the next item
  }
}

// ---- Host side: tensor maps (cached per weight tensor) and launch.
// Host helpers are plain functions, not lambdas (see moe_gemm.cu: nvcc and fmt inside lambdas).
PFN_cuTensorMapEncodeTiled_v12000 lookup_encode_fn() {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  MOELORA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
  MOELORA_CHECK_MSG(f && q == cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled is not available from the driver");
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
}
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = lookup_encode_fn();
  return fn;
}

// A 2-D row-major map of bytes: `rows` rows of `cols` bytes, `stride` bytes apart, boxes of
// box_cols x box_rows, in the 128-byte swizzle (FP8 weights, read by wgmma descriptors) or plain
// (NVFP4 codes and scales, read by the consumers' shared loads).
struct MapKey {
  const void* base;
  int64_t cols, rows, stride;
  int box_cols, box_rows;
  bool swizzle;
  bool operator==(const MapKey& o) const {
    return base == o.base && cols == o.cols && rows == o.rows && stride == o.stride && box_cols == o.box_cols &&
           box_rows == o.box_rows && swizzle == o.swizzle;
  }
};
struct MapKeyHash {
  size_t operator()(const MapKey& k) const {
    size_t h = std::hash<const void*>()(k.base);
    for (int64_t v : {k.cols, k.rows, k.stride, static_cast<int64_t>(k.box_cols), static_cast<int64_t>(k.box_rows),
                      static_cast<int64_t>(k.swizzle)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

CUtensorMap encode_map(const MapKey& k) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k.cols), static_cast<cuuint64_t>(k.rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k.stride)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(k.box_cols), static_cast<cuuint32_t>(k.box_rows)};
  const cuuint32_t estrides[2] = {1, 1};
  const CUresult r = encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(k.base), dims, strides, box,
                                 estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 k.swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOELORA_CHECK_MSG(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed ({} x {}, stride {}, box {} x {})", k.rows, k.cols,
                    k.stride, k.box_rows, k.box_cols);
  return map;
}

// Maps are pure functions of their key, so a cache hit is always right; the cache only saves the
// host ~1 us per map in eager steps (graph replay bakes the maps into the graph). Bounded: the
// keys are the expert weights, which are fixed.
CUtensorMap cached_map(const MapKey& key) {
  static std::mutex mu;
  static std::unordered_map<MapKey, CUtensorMap, MapKeyHash> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() > 4096) cache.clear();
  const CUtensorMap map = encode_map(key);
  cache.emplace(key, map);
  return map;
}

template <int BN, bool GU, int MODE>
int query_occupancy() {
  using C = WgCfg<BN, MODE>;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_wgmma_kernel<BN, GU, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  // All of the unified L1/shared storage as shared memory, so two CTAs fit (the default carveout
  // gave these CTAs 102 KB per SM: one CTA).
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_wgmma_kernel<BN, GU, MODE>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
  int o = 0;
  MOELORA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, moe_gemm_wgmma_kernel<BN, GU, MODE>, kThreads, C::kSmem));
  MOELORA_CHECK(o >= 1);
  return o;
}
template <int BN, bool GU, int MODE>
int occupancy_of() {
  static const int occ = query_occupancy<BN, GU, MODE>();
  return occ;
}

template <int BN, bool GU, int MODE>
void launch(const MoeGemmParams& p, cudaStream_t stream) {
  WgmmaParams wp;
  wp.g = p;
  const int64_t rows = static_cast<int64_t>(p.E) * (GU ? 2 * p.I : p.H);
  const int K = GU ? p.H : p.I;
  const int box_rows = GU ? kRowsPerItem / 2 : kRowsPerItem;
  if constexpr (MODE == kW4Bf16) {
    wp.w_map = cached_map(MapKey{p.w, K / 2, rows, K / 2, kKChunk / 2, box_rows, false});
    wp.s_map = cached_map(MapKey{p.w_group_scale, K, rows / 16, K, kKChunk, box_rows / 16, false});
  } else {
    wp.w_map = cached_map(MapKey{p.w, K, rows, K, kKChunk, box_rows, true});
  }
  const int nblocks = GU ? p.I / (kRowsPerItem / 2) : p.H / kRowsPerItem;
  const int64_t max_items = static_cast<int64_t>(p.max_tiles) * nblocks;
  const int grid =
      static_cast<int>(std::min<int64_t>(max_items, static_cast<int64_t>(moe_num_sms()) * occupancy_of<BN, GU, MODE>()));
  if (grid <= 0) return;
  moe_launch(moe_gemm_wgmma_kernel<BN, GU, MODE>, dim3(grid), dim3(kThreads), WgCfg<BN, MODE>::kSmem, stream, p.pdl, wp);
}

template <int BN, bool GU>
void launch_mode(const MoeGemmParams& p, cudaStream_t stream) {
  if (p.wtype == MoeWeightType::kNvfp4) launch<BN, GU, kW4Bf16>(p, stream);
  else if (!p.act_fp8) launch<BN, GU, kActBf16>(p, stream);
  else if (p.xq_lo == nullptr) launch<BN, GU, kActFp8>(p, stream);
  else launch<BN, GU, kActSplit>(p, stream);
}

template <bool GU>
void dispatch(const MoeGemmParams& p, cudaStream_t stream) {
  MOELORA_CHECK_MSG(cuda_plan::moe_wgmma_shape_ok(p.H, p.I), "the wgmma MoE GEMM needs H and I multiples of 128");
  const bool f4 = p.wtype == MoeWeightType::kNvfp4;
  MOELORA_CHECK_MSG(p.wtype == MoeWeightType::kFp8 || f4, "the wgmma MoE GEMM takes FP8 or NVFP4 weights");
  MOELORA_CHECK_MSG(!f4 || !p.act_fp8, "NVFP4 experts take bf16 activations (W4A16)");
  MOELORA_CHECK(!p.act_fp8 || (p.xq && p.xs && p.ldxq % 16 == 0 && (reinterpret_cast<uintptr_t>(p.xq) & 15) == 0 &&
                               (!p.xq_lo || (reinterpret_cast<uintptr_t>(p.xq_lo) & 15) == 0)));
  MOELORA_CHECK(p.x && p.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0);
  MOELORA_CHECK((reinterpret_cast<uintptr_t>(p.w) & 15) == 0 && p.tile_pairs && p.tiles && p.counters);
  MOELORA_CHECK(f4 ? (p.w_group_scale && p.w_global_scale && (reinterpret_cast<uintptr_t>(p.w_group_scale) & 15) == 0)
                   : p.w_scale != nullptr);
  MOELORA_CHECK(p.align_tile_rows == moe_gemm_tile_rows(p.tile));
  MOELORA_CHECK(GU ? (p.act && p.top_k >= 1) : (p.y != nullptr));
  switch (p.tile) {
    case MoeGemmTile::kDecode8: launch_mode<8, GU>(p, stream); break;
    case MoeGemmTile::kDecode16: launch_mode<16, GU>(p, stream); break;
    case MoeGemmTile::kDecode32: launch_mode<32, GU>(p, stream); break;
    case MoeGemmTile::kPrefill64: launch_mode<64, GU>(p, stream); break;
  }
}

template <int BN>
void init_modes() {
  occupancy_of<BN, true, kActBf16>(), occupancy_of<BN, false, kActBf16>();
  occupancy_of<BN, true, kActFp8>(), occupancy_of<BN, false, kActFp8>();
  occupancy_of<BN, true, kActSplit>(), occupancy_of<BN, false, kActSplit>();
  occupancy_of<BN, true, kW4Bf16>(), occupancy_of<BN, false, kW4Bf16>();
}

}  // namespace

void moe_gate_up_wgmma(const MoeGemmParams& p, cudaStream_t stream) { dispatch<true>(p, stream); }
void moe_down_wgmma(const MoeGemmParams& p, cudaStream_t stream) { dispatch<false>(p, stream); }

void moe_gemm_wgmma_init() {
  encode_fn();  // the driver entry point, looked up before any graph capture
  init_modes<8>();
  init_modes<16>();
  init_modes<32>();
  init_modes<64>();
}

}  // namespace moelora::cuda
