#include "backends/cuda_plan/moe_choices.h"

#include <algorithm>

namespace moelora::cuda_plan {

namespace {
// One CTA routes every token inside moe_align: on the H200 (run 1) this beat the separate router
// launch at T = 1 but lost at T = 64, where 32 warps route 2 tokens each in series.
constexpr int kFuseRouteMaxT = 8;
constexpr int kFuseRouteMaxE = 256;  // moe_align's fused router compiles register arrays for
constexpr int kFuseRouteMaxK = 32;   // E <= 256 and k <= 32
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

MoeTuning choose_moe_tuning(const MoeProblem& p) {
  MoeTuning t;
  t.tile = choose_moe_gemm_tile(p.T, p.k, p.E, p.H, p.I);
  t.fuse_route = p.has_logits && p.T <= kFuseRouteMaxT && p.E <= kFuseRouteMaxE && p.k <= kFuseRouteMaxK;
  // Separate shrink + expand measured faster than the fused LoRA launch at every batch of the
  // H200 sweep but one, where they tie (bench/RESULTS.md, moe_bench v2 vs v3: T = 8, one adapter,
  // 137.9 vs 137.4 us; elsewhere the fused launch lost by up to 79 us at T = 256).
  t.lora_fused = false;
  t.pdl = true;
  // W8A8 only when the operator allows it. H200 regime x tile sweep (2026-12-03, dev_moe_bench
  // regimes, base layer at Qwen3-30B-A3B shapes, us; best W8A16 tile -> W8A8 on the 16-row tile):
  // T = 16 147.2 -> 146.2, 32 192.0 -> 187.2, 64 221.4 -> 207.0, 128 254.9 -> 224.1, 256 356.0 ->
  // 293.5; the 16-row tile beat the 8-, 32- and 64-row ones in W8A8 at every T from 16 to 256, and
  // W8A8 lost on the prefill tile (T = 8192: 3455 -> 3656). Not the default: on the fixtures' FP8
  // checkpoints it moves the per-checkpoint median row error of `verify --backend cuda` from ~8e-3
  // to 2.1-2.7e-2, over the bf16 paths' 2e-2 bound (docs/numerics.md).
  const double per_expert = static_cast<double>(p.T) * p.k / std::max(p.E, 1);
  if (p.allow_fp8_activations) {
    if (per_expert > 1.5 && per_expert <= 24.0) t.tile = MoeGemmTile::kDecode16;
    t.act_fp8 = t.tile == MoeGemmTile::kDecode16 || t.tile == MoeGemmTile::kDecode32;
  }
  // The TMA + wgmma grouped GEMM (W8A16, FP8 experts). H200, `dev_moe_bench wgmma` run 4
  // (2026-12-04, base layer at Qwen3-30B-A3B shapes, best tile of each kernel, us): T = 1 28.5
  // (mma.sync) vs 36.7 (wgmma); 16: 147.0 vs 161.9; 64: 222.1 vs 232.0; 128: 259.2 vs 260.7;
  // 256 (16 tokens per expert): 357.8 (16-row tile) vs 344.9 (wgmma, 32-row tile), with 8
  // adapters 554.8 vs 536.8; prefill 8192 tokens: 3444 vs 4522. So only around 16 tokens per
  // expert; the window's edges (12, 24] sit between that win and the tie at 8 / losses from 32.
  if (p.fp8_experts && !t.act_fp8 && moe_wgmma_shape_ok(p.H, p.I) && per_expert > 12.0 && per_expert <= 24.0) {
    t.wgmma = true;
    t.tile = MoeGemmTile::kDecode32;
  }
  return t;
}

}  // namespace moelora::cuda_plan
