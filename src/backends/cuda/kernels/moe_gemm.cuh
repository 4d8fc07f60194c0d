// Grouped expert GEMMs of the routed MoE MLP, over the tiles of moe_align:
//   moe_gate_up: act[p] = silu(g) * u,  (g | u) = x[p / k] Wgu[e]^T (+ lora_delta[p])   [P, I] bf16
//                (the delta read from memory, or computed in the epilogue from u: MoeLoraGateUp)
//   moe_down:    y[p]   = act[p] Wd[e]^T                                               [P, H] f32
//   moe_reduce:  out[t] = sum_j w[t,j] (y[t*k+j] + lora_down_delta[t*k+j])              [T, H] bf16
//                (the delta read from memory, or computed in the reduce from u: MoeLoraDown)
// Weights are FP8 e4m3 with 128x128 block scales, NVFP4 (tensor-core kernels), or bf16. Two FP8
// regimes (chosen on the host,
// cuda_plan::choose_moe_tuning; docs/numerics.md):
//  - W8A16: FP8 is dequantised exactly in registers to bf16 and multiplied on the tensor cores
//    (mma.sync m16n8k16, f32 accumulation) with unquantised bf16 activations;
//  - W8A8 (act_fp8): activations quantised per token per 128 channels to e4m3 beforehand, e4m3 x
//    e4m3 on the tensor cores (mma.sync m16n8k32): no dequantisation, half the MMAs.
//  - (wgmma path) W8A16 as two e4m3 terms per activation (act_fp8 + xq_lo): see xq_lo.
// Either way the block scales (and the activation scales) multiply the f32 partial sum of each
// 64-wide K chunk; the only other rounding is the bf16 storage of act.
//
// Layouts (as packed by the CUDA backend's upload_experts):
//   gate_up w [E * 2I, H], expert e rows [e*2I, e*2I + I) gate, [e*2I + I, (e+1)*2I) up;
//           scale [E * 2*ceil(I/128), ceil(H/128)]: per expert ceil(I/128) gate row blocks, then
//           ceil(I/128) up row blocks (split_rows applied per expert).
//   down    w [E * H, I], scale [E * ceil(H/128), ceil(I/128)].
//   NVFP4   w the e2m1 codes of the same rows, [rows, K/2] bytes in cuda_plan/nvfp4_layout.h's
//           order; w_group_scale their e4m3 group scales tile-major ([rows/16][K/64][16][4]);
//           w_global_scale f32 weight_scale_2 * 2^26 per expert and half ([E][gate, up]) or per
//           expert (down). W4A16: each lane's 16 k of a chunk are one group, turned into bf16 by a
//           byte permutation and one multiply by the group scale (exact), the global scale applied
//           to the f32 sums.
// Requirements of the tensor-core kernels: H % 64 == 0, I % 64 == 0 (K chunks of 64; the kernels
// assert). Other shapes (H, I multiples of 16) take the generic kernels (moe_gemm_generic.cu,
// MoeGemmParams::generic: one warp per (tile, output feature) on the CUDA cores, W8A16 numerics in
// f32, same tiles and epilogues).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/moe_common.cuh"
#include "backends/cuda/kernels/moe_lora.cuh"
#include "backends/cuda_plan/moe_choices.h"

namespace moelora::cuda {

enum class MoeWeightType : int32_t { kFp8 = 0, kBf16 = 1, kNvfp4 = 2 };

// Tile shape of one GEMM launch: chosen on the host (cuda_plan::choose_moe_tuning) and handed
// to moe_align as its tile_rows, so the routing tiles and the GEMM agree.
using cuda_plan::MoeGemmTile;
using cuda_plan::moe_gemm_tile_rows;

struct MoeGemmParams {
  MoeWeightType wtype = MoeWeightType::kFp8;
  MoeGemmTile tile = MoeGemmTile::kDecode8;
  int E = 0, H = 0, I = 0, top_k = 0;
  const void* w = nullptr;          // gate_up or down weights (see layout above)
  const float* w_scale = nullptr;   // FP8 only
  const uint8_t* w_group_scale = nullptr;  // NVFP4 only (layout above)
  const float* w_global_scale = nullptr;   // NVFP4 only
  const bf16* x = nullptr;          // gate_up: hidden [T, H] (row p / top_k); down: act [P, I] (row p)
  int64_t ldx = 0;                  // elements
  // W8A8 (FP8 weights only): the same rows quantised per token per 128 channels
  // (launch_fp8_quant_per_token, token-major scales); the kernel then multiplies e4m3 x e4m3 and
  // reads neither x nor ldx.
  bool act_fp8 = false;
  const uint8_t* xq = nullptr;      // [rows, ldxq] e4m3
  int64_t ldxq = 0;                 // bytes
  const float* xs = nullptr;        // [rows, ldxs] scales
  int64_t ldxs = 0;
  // wgmma path only: the low terms of fp8_quant's split form (xq then holds the high terms and xs
  // their power-of-two scales): bf16 activations to within 2^-17 of each group's amax, multiplied
  // as two e4m3 x e4m3 products (W8A16 numerics without dequantising the weights).
  const uint8_t* xq_lo = nullptr;
  // Routing (moe_align outputs).
  const int32_t* tile_pairs = nullptr;  // [tiles, tile_rows] pair per tile row, -1 = padding
  int align_tile_rows = 0;              // moe_align's tile_rows: must equal moe_gemm_tile_rows(tile)
  const MoeTile* tiles = nullptr;
  const int32_t* counters = nullptr;    // moe_align counters (kMoeCntTiles)
  int max_tiles = 0;                    // worst case, sizes the persistent grid
  // gate_up epilogue
  const bf16* lora_delta = nullptr;  // [P, 2I] gate_up LoRA delta (pre-activation) or null
  MoeLoraGateUp lora_gu;             // or the delta computed here (lora_gu.token_slot set; moe_lora.cuh)
  bf16* act = nullptr;               // [P, I]
  // down epilogue
  float* y = nullptr;                // [P, H]
  bool pdl = false;
  // Hopper path (moe_gemm_wgmma.cu: TMA weight ring, warpgroup MMAs, producer warp) instead of the
  // mma.sync kernels; cuda_plan::choose_moe_tuning decides. FP8 weights (bf16, W8A8 or split-form
  // activations) or NVFP4 weights (bf16 activations), H and I multiples of 128
  // (cuda_plan::moe_wgmma_shape_ok).
  bool wgmma = false;
  // The generic kernels (moe_gemm_generic.cu) instead of either tensor-core path: shapes no tile of
  // theirs fits (cuda_plan::choose_moe_tuning). bf16 activations only.
  bool generic = false;
  // Down only: the launch directly follows moe_gate_up, both with PDL, and moe_align precedes
  // gate_up: the kernel may then read the tiles and prefetch its first weights before waiting.
  bool early_prefetch = false;
  // The kernel runs its main loop without waiting for its stream predecessor and waits for it only
  // before its epilogue (launch.cuh, waiting before the epilogue). Valid where that predecessor is a
  // MoE LoRA kernel (shrink, expand or fused) whose output the epilogue alone reads (gate_up: u or
  // the delta) or this kernel does not read at all (down: moe_reduce reads the down shrink's u).
  // MoeTuning::lora_shrink_beside_gemm.
  bool wait_before_epilogue = false;
};

void moe_gate_up(const MoeGemmParams& p, cudaStream_t stream);
void moe_down(const MoeGemmParams& p, cudaStream_t stream);
// The Hopper path on its own (moe_gate_up / moe_down call it when p.wgmma).
void moe_gate_up_wgmma(const MoeGemmParams& p, cudaStream_t stream);
void moe_down_wgmma(const MoeGemmParams& p, cudaStream_t stream);
void moe_gemm_wgmma_init();
// The generic kernels on their own (moe_gate_up / moe_down call them when p.generic).
void moe_gate_up_generic(const MoeGemmParams& p, cudaStream_t stream);
void moe_down_generic(const MoeGemmParams& p, cudaStream_t stream);

struct MoeReduceParams {
  const float* y = nullptr;           // [P, H]
  const bf16* lora_delta = nullptr;   // [P, H] down LoRA delta or null
  MoeLoraDown lora_d;                 // or the delta computed here (lora_d.token_slot set; moe_lora.cuh)
  const int32_t* ids = nullptr;       // [T, k] (pairs with ids outside [0, E) are skipped)
  const float* weights = nullptr;     // [T, k]
  int T = 0, k = 0, E = 0, H = 0;
  bf16* out = nullptr;                // [T, ldo]
  int64_t ldo = 0;
  bool pdl = false;
};
void moe_reduce(const MoeReduceParams& p, cudaStream_t stream);

// Sets kernel attributes (shared-memory limits) and caches occupancy for every GEMM variant.
// Called lazily by the launchers; call it once before capturing a graph.
void moe_gemm_init();

}  // namespace moelora::cuda
