// Per-shape choices of the CUDA MoE kernels, made on the host from the problem alone (no GPU
// needed: tests/cuda_plan checks them on the CPU). The kernels take what is chosen here through
// their params structs; no kernel file picks a variant by itself. Every threshold cites the
// measurement it comes from (bench/RESULTS.md).
#pragma once

#include <cstdint>

namespace moelora::cuda_plan {

// Token-tile shape of one grouped-GEMM launch; moe_align builds its tiles with the same rows.
enum class MoeGemmTile : int32_t {
  kDecode8 = 0,    // 8-token tiles, 4 warps split K: few tokens per expert, memory-bound
  kDecode16 = 1,   // 16-token tiles
  kDecode32 = 2,   // 32-token tiles
  kPrefill64 = 3,  // 64-token tiles, 4 warps split the weight rows and share the token tile
};
constexpr int kNumMoeGemmTiles = 4;
int moe_gemm_tile_rows(MoeGemmTile t);

// One routed-MoE layer call: T tokens routed to k of E experts, hidden H, expert intermediate I.
struct MoeProblem {
  int T = 0, k = 0, E = 0, H = 0, I = 0;
  bool has_logits = true;  // routing runs in the layer (else ids/weights are given)
  // The operator allows W8A8 for FP8 experts (--moe-fp8-activations); off: W8A16 everywhere.
  bool allow_fp8_activations = false;
  bool fp8_experts = true;     // FP8 block-scaled experts (else bf16 or NVFP4)
  bool nvfp4_experts = false;  // NVFP4 experts: the mma.sync kernels' 4-bit variant (see choose_moe_tuning)
};

struct MoeTuning {
  MoeGemmTile tile = MoeGemmTile::kDecode8;
  bool fuse_route = true;   // route inside moe_align (one launch less)
  bool lora_fused = false;  // each LoRA half as one shrink+expand launch
  // The gate_up half's expand inside the gate_up GEMM's epilogue (only its shrink launches, on the
  // main stream); lora_fused then concerns the down half alone.
  bool lora_in_gemm = false;
  // The down half's expand inside moe_reduce (only its shrink launches): the weighted sum adds
  // u . B of each pair itself instead of reading a [P, H] delta written by an expand kernel. Bit
  // for bit the expand kernel (same sums, same bf16 rounding); lora_fused is then ignored for the
  // down half. choose_moe_tuning picks it from one pair per expert up (measured, moe_choices.cpp).
  bool lora_down_in_reduce = false;
  // The LoRA kernels take one item per routed pair (its slot and expert read from token_slot and
  // ids) instead of moe_align's (slot, expert) groups: moe_align skips the LoRA grouping and the
  // LoRA grids are sized by the step's pairs. Same bits either way (moe_lora.cuh, MoeLoraPairs).
  // choose_moe_tuning picks it up to two pairs per expert (measured, moe_choices.cpp).
  bool lora_direct = false;
  // Every MoE LoRA kernel on the main stream, each grouped GEMM right behind its half's LoRA
  // kernels and waiting for them only before its epilogue (MoeGemmParams::wait_before_epilogue):
  // the gate_up shrink runs beside gate_up's main loop (its epilogue reads u), the down shrink beside
  // down's (moe_reduce reads u), with no side stream, no events and PDL up to moe_reduce. Same bits
  // as the other placements (the op suite compares them). choose_moe_tuning picks it up to half a
  // pair per expert (measured, moe_choices.cpp); CudaBackendOptions::moe_lora_shrink_beside_gemm
  // (`--no-moe-lora-beside-gemm`) turns it off.
  bool lora_shrink_beside_gemm = false;
  bool pdl = true;          // programmatic dependent launch between consecutive kernels
  // FP8 experts only: W8A8 (activations quantised per token per 128 channels, e4m3 MMA) instead
  // of W8A16 (exact bf16 activations, weights dequantised in registers). docs/numerics.md.
  bool act_fp8 = false;
  // FP8 or NVFP4 experts: the Hopper grouped GEMM (TMA weight ring + wgmma, moe_gemm_wgmma.cu)
  // instead of the mma.sync kernels. Needs moe_wgmma_shape_ok.
  bool wgmma = false;
  // With wgmma and W8A16: the activations as two e4m3 terms (fp8_quant's split form) multiplied by
  // e4m3 x e4m3 wgmmas instead of dequantising the weights in registers (moe_gemm_wgmma.cu).
  bool act_split = false;
  // The generic grouped GEMMs (moe_gemm_generic.cu: CUDA cores, W8A16 in f32) for shapes no
  // tensor-core tile takes (!moe_mma_shape_ok); then wgmma, act_fp8 and act_split are off.
  bool generic = false;
};

// Shapes the tensor-core grouped GEMMs (moe_gemm.cu) take: both GEMMs' K (H, I) in whole 64-wide
// chunks. Others, with H and I multiples of 16, run the generic kernels.
bool moe_mma_shape_ok(int H, int I);
// Shapes some grouped GEMM takes (the generic kernels: H and I multiples of 16, which the LoRA
// kernels' 16-byte rows and moe_reduce's 4-wide rows also need).
inline constexpr int kMoeShapeMultiple = 16;
bool moe_shape_supported(int H, int I);

// Shapes the wgmma grouped GEMM takes: both GEMMs' K (H, I) in whole 128-wide scale blocks.
bool moe_wgmma_shape_ok(int H, int I);

// Tile for a batch of T tokens routed to k of E experts (expected tokens per expert T*k/E).
MoeGemmTile choose_moe_gemm_tile(int T, int k, int E, int H, int I);
MoeTuning choose_moe_tuning(const MoeProblem& p);

}  // namespace moelora::cuda_plan
