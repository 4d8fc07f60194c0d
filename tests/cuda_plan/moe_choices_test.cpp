// The MoE kernel choices: the tile follows the expected tokens per expert as the H200 sweep
// measured (bench/RESULTS.md), shapes a tile cannot take never get it, and the route fusion
// stays within what moe_align's fused router handles.
#include <gtest/gtest.h>

#include <utility>

#include "backends/cuda_plan/moe_choices.h"

namespace moelora::cuda_plan {
namespace {

TEST(MoeChoices, TileFollowsTokensPerExpertAtQwen3Shapes) {
  // Qwen3-30B-A3B: 8 of 128 experts, H 2048, I 768.
  auto tile = [](int T) { return choose_moe_gemm_tile(T, 8, 128, 2048, 768); };
  EXPECT_EQ(tile(1), MoeGemmTile::kDecode8);
  EXPECT_EQ(tile(64), MoeGemmTile::kDecode8);     // 4 tokens per expert
  EXPECT_EQ(tile(128), MoeGemmTile::kDecode16);   // 8
  EXPECT_EQ(tile(256), MoeGemmTile::kDecode16);   // 16
  EXPECT_EQ(tile(512), MoeGemmTile::kDecode32);   // 32
  EXPECT_EQ(tile(8192), MoeGemmTile::kPrefill64);
}

TEST(MoeChoices, ThePrefillTileNeedsShapesItDivides) {
  EXPECT_EQ(choose_moe_gemm_tile(8192, 8, 128, 2048, 768), MoeGemmTile::kPrefill64);
  EXPECT_EQ(choose_moe_gemm_tile(8192, 8, 128, 2048 + 64, 768), MoeGemmTile::kDecode32);  // H % 128
  EXPECT_EQ(choose_moe_gemm_tile(8192, 8, 128, 2048, 768 + 32), MoeGemmTile::kDecode32);  // I % 64
}

TEST(MoeChoices, TileRowsMatchTheirNames) {
  EXPECT_EQ(moe_gemm_tile_rows(MoeGemmTile::kDecode8), 8);
  EXPECT_EQ(moe_gemm_tile_rows(MoeGemmTile::kDecode16), 16);
  EXPECT_EQ(moe_gemm_tile_rows(MoeGemmTile::kDecode32), 32);
  EXPECT_EQ(moe_gemm_tile_rows(MoeGemmTile::kPrefill64), 64);
}

TEST(MoeChoices, RoutingIsFusedOnlyForSmallBatchesItCanRoute) {
  MoeProblem p{.T = 4, .k = 8, .E = 128, .H = 2048, .I = 768};
  EXPECT_TRUE(choose_moe_tuning(p).fuse_route);
  p.T = 64;
  EXPECT_FALSE(choose_moe_tuning(p).fuse_route);
  p.T = 4;
  p.E = 384;  // more experts than moe_align's fused router takes
  EXPECT_FALSE(choose_moe_tuning(p).fuse_route);
  p.E = 128;
  p.has_logits = false;  // ids given: nothing to route
  EXPECT_FALSE(choose_moe_tuning(p).fuse_route);
}

TEST(MoeChoices, DefaultsAreTheMeasuredFastestPaths) {
  const MoeTuning t = choose_moe_tuning(MoeProblem{.T = 64, .k = 8, .E = 128, .H = 2048, .I = 768});
  EXPECT_TRUE(t.pdl);
  EXPECT_FALSE(t.lora_fused);
  EXPECT_TRUE(t.lora_in_gemm);  // 4 tokens per expert: the gate_up expand in the GEMM's epilogue
  MoeProblem big{.T = 256, .k = 8, .E = 128, .H = 2048, .I = 768};
  EXPECT_FALSE(choose_moe_tuning(big).lora_in_gemm);  // 16 per expert: its own kernel measured faster
}

// The LoRA items and the down expand's place follow pairs per expert (H100 `dev_moe_bench direct`,
// 2026-12-06): per pair up to 2 (Qwen3: 32 tokens), the down expand inside moe_reduce from 1 (16
// tokens), each kernel's own form elsewhere.
TEST(MoeChoices, LoraItemsAndDownExpandFollowPairsPerExpert) {
  auto at = [](int T, int k, int E) { return choose_moe_tuning(MoeProblem{.T = T, .k = k, .E = E, .H = 2048, .I = 768}); };
  for (int T : {1, 2, 8, 32}) EXPECT_TRUE(at(T, 8, 128).lora_direct) << T;
  for (int T : {33, 64, 256}) EXPECT_FALSE(at(T, 8, 128).lora_direct) << T;
  for (int T : {1, 4, 8, 15}) EXPECT_FALSE(at(T, 8, 128).lora_down_in_reduce) << T;
  for (int T : {16, 32, 64, 256}) EXPECT_TRUE(at(T, 8, 128).lora_down_in_reduce) << T;
  // Mixtral's 8 experts, top 2: a quarter of a pair per expert per token.
  EXPECT_TRUE(at(8, 2, 8).lora_direct);
  EXPECT_FALSE(at(9, 2, 8).lora_direct);
  EXPECT_FALSE(at(3, 2, 8).lora_down_in_reduce);
  EXPECT_TRUE(at(4, 2, 8).lora_down_in_reduce);
}

// The LoRA shrinks beside the GEMMs up to half a pair per expert (H100 `dev_moe_bench beside`,
// 2026-12-07: faster to 8 tokens at Qwen3 shapes, +1.2 % at 16, up to +3.4 % at 256).
TEST(MoeChoices, LoraBesideTheGemmsUpToHalfAPairPerExpert) {
  auto at = [](int T, int k, int E) { return choose_moe_tuning(MoeProblem{.T = T, .k = k, .E = E, .H = 2048, .I = 768}); };
  for (int T : {1, 2, 4, 8}) EXPECT_TRUE(at(T, 8, 128).lora_shrink_beside_gemm) << T;
  for (int T : {9, 16, 64, 256}) EXPECT_FALSE(at(T, 8, 128).lora_shrink_beside_gemm) << T;
  EXPECT_TRUE(at(2, 2, 8).lora_shrink_beside_gemm);  // Mixtral: a quarter of a pair per expert per token
  EXPECT_FALSE(at(3, 2, 8).lora_shrink_beside_gemm);
}

TEST(MoeChoices, Fp8ActivationsOnlyWhenAllowedAndOnlyWhereTheyWereFaster) {
  MoeProblem p{.T = 256, .k = 8, .E = 128, .H = 2048, .I = 768};
  EXPECT_FALSE(choose_moe_tuning(p).act_fp8);  // exact activations unless the operator opts in
  p.allow_fp8_activations = true;
  for (int T : {2, 32, 64, 128, 256}) {  // W8A8 on the wgmma GEMM won at each of these
    p.T = T;
    const MoeTuning t = choose_moe_tuning(p);
    EXPECT_TRUE(t.act_fp8) << T;
    EXPECT_TRUE(t.wgmma) << T;
    EXPECT_FALSE(t.act_split) << T;
  }
  p.T = 1;  // the mma.sync W8A16 kernel was as fast
  EXPECT_FALSE(choose_moe_tuning(p).act_fp8);
  p.T = 8192;  // the prefill tile: W8A8 measured slower on mma.sync, unmeasured on wgmma
  EXPECT_EQ(choose_moe_tuning(p).tile, MoeGemmTile::kPrefill64);
  EXPECT_FALSE(choose_moe_tuning(p).act_fp8);
  // Shapes the wgmma GEMM does not take: W8A8 on mma.sync's 16-row tile from 1.5 tokens per expert.
  p.H = 2048 + 64;
  p.T = 64;
  MoeTuning t = choose_moe_tuning(p);
  EXPECT_TRUE(t.act_fp8);
  EXPECT_FALSE(t.wgmma);
  EXPECT_EQ(t.tile, MoeGemmTile::kDecode16);
  p.T = 8;
  EXPECT_FALSE(choose_moe_tuning(p).act_fp8);
}

TEST(MoeChoices, TheSplitFormWgmmaGemmFromTwoTokensToTwentyFourPerExpert) {
  MoeProblem p{.T = 256, .k = 8, .E = 128, .H = 2048, .I = 768};  // 16 tokens per expert
  MoeTuning t = choose_moe_tuning(p);
  EXPECT_TRUE(t.wgmma);
  EXPECT_TRUE(t.act_split);
  EXPECT_FALSE(t.act_fp8);
  EXPECT_EQ(t.tile, MoeGemmTile::kDecode16);
  for (int T : {2, 8, 16, 64}) {  // up to 4 tokens per expert: the 8-row tile
    p.T = T;
    t = choose_moe_tuning(p);
    EXPECT_TRUE(t.wgmma && t.act_split) << T;
    EXPECT_EQ(t.tile, MoeGemmTile::kDecode8) << T;
  }
  p.T = 128;
  EXPECT_EQ(choose_moe_tuning(p).tile, MoeGemmTile::kDecode16);
  for (int T : {1, 512, 8192}) {  // mma.sync: as fast at one token; prefill not measured on wgmma
    p.T = T;
    EXPECT_FALSE(choose_moe_tuning(p).wgmma) << T;
  }
  p.T = 256;
  p.fp8_experts = false;  // bf16 experts: the wgmma GEMM takes FP8 weights only
  EXPECT_FALSE(choose_moe_tuning(p).wgmma);
  p.fp8_experts = true;
  p.H = 2048 + 64;  // K in whole 128-wide scale blocks only
  EXPECT_FALSE(choose_moe_tuning(p).wgmma);
  EXPECT_FALSE(moe_wgmma_shape_ok(2048, 768 + 64));
  EXPECT_TRUE(moe_wgmma_shape_ok(7168, 2048));  // DeepSeek-V3
}

TEST(MoeChoices, Nvfp4ExpertsRunTheMmaSyncKernels) {
  // The measured 4-bit kernels are the mma.sync ones: never wgmma (its 4-bit mode is not measured
  // yet), W8A8 or the split form, whatever the batch or the operator's W8A8 permission; the tile
  // as for other experts.
  for (int T : {1, 8, 64, 128, 256, 8192}) {
    MoeProblem p{.T = T, .k = 8, .E = 128, .H = 2048, .I = 768};
    p.fp8_experts = false;
    p.nvfp4_experts = true;
    p.allow_fp8_activations = true;
    const MoeTuning t = choose_moe_tuning(p);
    EXPECT_FALSE(t.wgmma || t.act_fp8 || t.act_split || t.generic) << T;
    EXPECT_EQ(t.tile, choose_moe_gemm_tile(T, 8, 128, 2048, 768)) << T;
  }
}

TEST(MoeChoices, ShapesNoTensorCoreTileTakesRunTheGenericGemmsInBf16) {
  // H or I a multiple of 16 but not of 64 (e.g. moe_intermediate_size 96): the generic kernels,
  // whatever the batch, and never W8A8, split form or wgmma, which they do not implement.
  for (auto [H, I] : {std::pair{2048, 96}, std::pair{80, 768}, std::pair{208, 144}, std::pair{256, 48}}) {
    for (int T : {1, 8, 64, 256, 8192}) {
      MoeProblem p{.T = T, .k = 8, .E = 128, .H = H, .I = I};
      p.allow_fp8_activations = true;
      const MoeTuning t = choose_moe_tuning(p);
      EXPECT_TRUE(t.generic) << H << "/" << I << " T " << T;
      EXPECT_FALSE(t.wgmma || t.act_fp8 || t.act_split) << H << "/" << I << " T " << T;
    }
    EXPECT_FALSE(moe_mma_shape_ok(H, I));
    EXPECT_TRUE(moe_shape_supported(H, I));
  }
  // Shapes the tensor-core kernels take never go generic.
  for (int T : {1, 8, 64, 256, 8192}) {
    EXPECT_FALSE(choose_moe_tuning(MoeProblem{.T = T, .k = 8, .E = 128, .H = 2048, .I = 768}).generic) << T;
    EXPECT_FALSE(choose_moe_tuning(MoeProblem{.T = T, .k = 2, .E = 8, .H = 128, .I = 192}).generic) << T;
  }
  EXPECT_TRUE(moe_mma_shape_ok(128, 192));
  EXPECT_FALSE(moe_shape_supported(2048, 776));  // a multiple of 8 only
  EXPECT_FALSE(moe_shape_supported(0, 768));
}

}  // namespace
}  // namespace moelora::cuda_plan
