#include "backends/cuda_plan/moe_choices.h"

#include <algorithm>

namespace moelora::cuda_plan {

namespace {
// One CTA routes every token inside moe_align: on the H200 (run 1) this beat the separate router
// launch at T = 1 but lost at T = 64, where 32 warps route 2 tokens each in series.
constexpr int kFuseRouteMaxT = 8;
constexpr int kFuseRouteMaxE = 256;  // moe_align's fused router compiles register arrays for
constexpr int kFuseRouteMaxK = 32;   // E <= 256 and k <= 32
// The gate_up LoRA expand in the GEMM epilogue up to this many tokens per expert. H200,
// `dev_moe_bench lora` (2026-12-05, Qwen3-30B-A3B shapes, r 16, us, expand kernel -> in the GEMM,
// 1 / 8 adapters): T = 1 63.1 -> 61.9 / 63.0 -> 62.0, 2 77.4 -> 74.4 / 77.3 -> 74.3, 64 240.3 ->
// 241.0 / 272.8 -> 267.9, 128 272.2 -> 273.6 / 323.6 -> 315.8, but 256 343.1 -> 364.1 / 415.0 ->
// 425.1: with 16 tokens per expert the epilogue's per-row reads of B cost more than the kernel
// that reads each (slot, expert) B once for a whole tile. Between (T = 4 to 32) they are within
// 3.3 us either way.
constexpr double kMoeLoraInGemmMaxPerExpert = 8.0;
// The LoRA kernels on one item per routed pair up to this many pairs per expert, moe_align's
// (slot, expert) groups above; the down expand inside moe_reduce from kMoeLoraDownInReduceMinPerExpert
// up. H100 (`dev_moe_bench direct`, 2026-12-06, Qwen3-30B-A3B shapes, r 16, graph replay, us;
// bench/logs/2026-12-06-h100-moe-direct.log), grouped -> per pair, 1 / 8 adapters: T = 1 65.9 ->
// 57.3 / 66.0 -> 57.2, 8 151.8 -> 144.0 / 161.2 -> 144.7, 32 261.6 -> 255.5 / 276.6 -> 263.3, but
// 64 295.7 -> 303.9 / 326.4 -> 314.8 and 256 399.2 -> 563.2 / 477.1 -> 582.5: a per-pair item
// reads its B rows alone, a group reads them once for all its pairs, which pays once an expert
// holds a few pairs of one adapter. Per pair with the down expand in moe_reduce, 8 adapters: T = 1
// 61.3 (per pair alone 57.2), 8 145.3 (144.7), 16 193.2 (196.0), 32 257.5 (263.3), 64 301.2, 128
// 355.2 (grouped 374.4); on the grouped items (H100, 2026-12-05) it won -1.5 to -4.9 % from 32 to
// 256 tokens with 8 adapters, within 2 % with 1, and lost +7.5 % at 1 token.
constexpr double kMoeLoraDirectMaxPerExpert = 2.0;
constexpr double kMoeLoraDownInReduceMinPerExpert = 1.0;
// The LoRA shrinks beside the grouped GEMMs (one stream, each GEMM waiting for them only before its
// epilogue) up to this many pairs per expert. H100 (`dev_moe_bench beside`, 2026-12-07, Qwen3-30B-A3B
// shapes, r 16, graph replay, us; bench/logs/2026-12-07-h100-moe-lora-beside.log), default ->
// beside, 8 adapters: T = 1 57.2 -> 46.3 (+79 % -> +45 % over the base 32.0), 2 69.8 -> 62.0, 4 98.6
// -> 89.9, 8 144.7 -> 139.9, but 16 193.2 -> 195.6, 32 258.3 -> 258.9, 64 313.1 -> 313.2, 128 354.4
// -> 358.9, 256 460.3 -> 475.9 (1 adapter alike: wins to T = 8, +1.2 % at 16). Not profiled why it
// loses above; likely the shrink's blocks (up to 1056 from 64 tokens) take SMs the longer GEMM would
// use. The decode step with 8 adapters, beside at every batch (same card): 1 token -8.0 %, 8 -2.9 %,
// 64 -0.6 %, 256 +2.1 %.
constexpr double kMoeLoraBesideMaxPerExpert = 0.5;
}  // namespace

int moe_gemm_tile_rows(MoeGemmTile t) {
  switch (t) {
    case MoeGemmTile::kDecode8: return 8;
    case MoeGemmTile::kDecode16: return 16;
    case MoeGemmTile::kDecode32: return 32;
    case MoeGemmTile::kPrefill64: return 64;
  }
  return 8;
}

// Thresholds from the H200 tile sweep (bench/RESULTS.md, Qwen3-30B-A3B shapes, 8 of 128 experts):
// 8-row tiles win up to 4 tokens per expert (T <= 64), 16-row tiles at 8 and 16 (T = 128, 256: 16
// beat 32 by 7 % at T = 256 although most experts then need two tiles: the second read hits L2
// and 3 CTAs fit an SM instead of 2). Above that the 32- and 64-row tiles amortise the dequant.
// The 64-row tile splits the weight rows over 4 warps of 16 x 2: it needs I % 64 and H % 128.
MoeGemmTile choose_moe_gemm_tile(int T, int k, int E, int H, int I) {
  const double per_expert = static_cast<double>(T) * k / std::max(E, 1);
  if (per_expert <= 5.0) return MoeGemmTile::kDecode8;
  if (per_expert <= 24.0) return MoeGemmTile::kDecode16;
  if (per_expert <= 40.0 || I % 64 != 0 || H % 128 != 0) return MoeGemmTile::kDecode32;
  return MoeGemmTile::kPrefill64;
}

bool moe_wgmma_shape_ok(int H, int I) { return H > 0 && I > 0 && H % 128 == 0 && I % 128 == 0; }
bool moe_mma_shape_ok(int H, int I) { return H > 0 && I > 0 && H % 64 == 0 && I % 64 == 0; }
bool moe_shape_supported(int H, int I) {
  return H > 0 && I > 0 && H % kMoeShapeMultiple == 0 && I % kMoeShapeMultiple == 0;
}

MoeTuning choose_moe_tuning(const MoeProblem& p) {
  MoeTuning t;
  t.tile = choose_moe_gemm_tile(p.T, p.k, p.E, p.H, p.I);
  t.fuse_route = p.has_logits && p.T <= kFuseRouteMaxT && p.E <= kFuseRouteMaxE && p.k <= kFuseRouteMaxK;
  // Separate shrink + expand measured faster than the fused LoRA launch at every batch of the
  // H200 sweep but one, where they tie (bench/RESULTS.md, moe_bench v2 vs v3: T = 8, one adapter,
  // 137.9 vs 137.4 us; elsewhere the fused launch lost by up to 79 us at T = 256).
  t.lora_fused = false;
  // The gate_up expand in the GEMM's epilogue: one launch and the [P, 2I] delta's write and read
  // off the critical path (the delta must be complete before SwiGLU).
  const double pairs_per_expert = static_cast<double>(p.T) * p.k / std::max(p.E, 1);
  t.lora_in_gemm = pairs_per_expert <= kMoeLoraInGemmMaxPerExpert;
  t.lora_direct = pairs_per_expert <= kMoeLoraDirectMaxPerExpert;
  t.lora_down_in_reduce = pairs_per_expert >= kMoeLoraDownInReduceMinPerExpert;
  t.lora_shrink_beside_gemm = pairs_per_expert <= kMoeLoraBesideMaxPerExpert;
  t.pdl = true;
  if (!moe_mma_shape_ok(p.H, p.I)) {
    // No tensor-core tile fits: the generic kernels, in bf16 activations whatever the operator
    // allowed (they have no W8A8 form). Any tile works for them; a larger one rereads each weight
    // row from L1 for more rows.
    t.generic = true;
    return t;
  }
  const double per_expert = static_cast<double>(p.T) * p.k / std::max(p.E, 1);
  // NVFP4 experts: the W4A16 variant of the mma.sync kernels (moe_gemm.cu), on the tiles chosen
  // for FP8 above. H200, `dev_moe_bench nvfp4` (2026-12-05, bench/RESULTS.md): 26.2 us at 1 token,
  // 227.5 at 64 (2.6-2.8x its 4-bit floor from 8 to 64 tokens), as fast as the FP8 mma.sync kernel.
  // The wgmma GEMM's 4-bit mode (MoeTuning::wgmma with NVFP4 experts) is not chosen: written
  // without a GPU, it is only forced by the op suite and the workbench until it is measured.
  if (p.nvfp4_experts) return t;
  // The Hopper grouped GEMM with e4m3 x e4m3 wgmmas from shared memory, FP8 experts. H200,
  // `dev_moe_bench split` (2026-12-04, base layer at Qwen3-30B-A3B shapes, us; bench/RESULTS.md):
  // best mma.sync W8A16 tile -> wgmma, activations in the split form (W8A16 numerics) on the 8-row
  // tile up to 4 tokens per expert, the 16-row one above: T = 1 28.6 -> 29.9 (t8), 2 42.5 -> 41.6,
  // 8 100.8 -> 87.0, 16 147.3 -> 123.3, 64 221.4 -> 172.5, 128 262.2 -> 181.8 (t16), 256 357.5 ->
  // 211.2 (t16); 8 adapters at 64 tokens 318.0 -> 272.2, at 256 557.4 -> 412.4. The dequantising
  // wgmma kernel of the previous run lost to both everywhere but 128-256 tokens, so it is no
  // longer chosen. Prefill (over 24 tokens per expert) was not measured on it: mma.sync stays.
  // W8A8 only when the operator allows it (--moe-fp8-activations): on the same GEMM it measured
  // 29.3 (t8) at T = 1, 169.9 at 64, 177.1 (t16) at 128, 194.1 at 256, against W8A8 on mma.sync's
  // 16-row tile 33.4 / 207.8 / 224.5 / 293.9. Not the default: on the fixtures' FP8 checkpoints it
  // moves the per-checkpoint median row error of `verify --backend cuda` from ~8e-3 to 2.1-2.7e-2,
  // over the bf16 paths' 2e-2 bound (docs/numerics.md).
  if (p.fp8_experts && moe_wgmma_shape_ok(p.H, p.I) && per_expert > 0.1 && per_expert <= 24.0) {
    t.wgmma = true;
    t.tile = per_expert <= 4.0 ? MoeGemmTile::kDecode8 : MoeGemmTile::kDecode16;
    t.act_fp8 = p.allow_fp8_activations;
    t.act_split = !p.allow_fp8_activations;
    return t;
  }
  // Shapes the wgmma GEMM does not take (H or I not in whole 128-wide blocks): W8A8 on mma.sync's
  // 16-row tile where it won (2026-12-03 regime sweep: T = 16 147.2 -> 146.2, 64 221.4 -> 207.0,
  // 256 356.0 -> 293.5; it lost on the prefill tile).
  if (p.allow_fp8_activations) {
    if (per_expert > 1.5 && per_expert <= 24.0) t.tile = MoeGemmTile::kDecode16;
    t.act_fp8 = t.tile == MoeGemmTile::kDecode16 || t.tile == MoeGemmTile::kDecode32;
  }
  return t;
}

}  // namespace moelora::cuda_plan
