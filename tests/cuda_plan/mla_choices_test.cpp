// The absorbed-MLA kernels' per-call plan (cuda_plan::choose_mla_plan), checked without a GPU:
// passes keep the float32 scratch under its budget, KV splits appear only when the grid would
// leave SMs idle, and every position of the longest context falls in exactly one split.
#include <gtest/gtest.h>

#include <random>

#include "backends/cuda_plan/mla_choices.h"

namespace moelora::cuda_plan {
namespace {

MlaProblem deepseek(int tokens, int max_positions, int lora_rank_stride = 0) {
  MlaProblem p;
  p.tokens = tokens;
  p.heads = 128;
  p.latent = 512;
  p.v_dim = 128;
  p.lora_rank_stride = lora_rank_stride;
  p.max_positions = max_positions;
  p.num_sms = 132;
  return p;
}

// What every plan must satisfy, whatever the problem.
void expect_consistent(const MlaProblem& p, const MlaPlan& plan) {
  SCOPED_TRACE(::testing::Message() << "T " << p.tokens << " heads " << p.heads << " R " << p.latent << " ranks "
                                    << p.lora_rank_stride << " positions " << p.max_positions);
  EXPECT_GE(plan.chunk_tokens, 1);
  EXPECT_LE(plan.chunk_tokens, p.tokens);
  EXPECT_GE(plan.splits, 1);
  EXPECT_LE(plan.splits, kMlaMaxSplits);
  EXPECT_TRUE(plan.query_cols == 32 || plan.query_cols == 128);
  EXPECT_TRUE(plan.output_cols == 32 || plan.output_cols == 128);
  // Every token of the bound divides its context over the grid's splits: whole tiles, every
  // position in exactly one split, no split empty; the longest context uses all of them.
  for (int n : {1, 2, 63, 64, 65, 127, 128, 129, 513, p.max_positions / 2 + 1, p.max_positions - 1, p.max_positions}) {
    if (n < 1 || n > p.max_positions) continue;
    const MlaTokenSplit ts = mla_token_split(n, plan.splits);
    EXPECT_EQ(ts.chunk % kMlaTilePositions, 0) << n;
    EXPECT_GE(ts.count, 1) << n;
    EXPECT_LE(ts.count, plan.splits) << n;
    EXPECT_GE(int64_t{ts.count} * ts.chunk, n) << n;
    EXPECT_LT(int64_t{ts.count - 1} * ts.chunk, n) << n;
  }
  EXPECT_EQ(mla_token_split(p.max_positions, plan.splits).count, plan.splits);
  const size_t rows = static_cast<size_t>(plan.chunk_tokens) * p.heads;
  EXPECT_GE(plan.latent_bytes, rows * p.latent * 4);
  EXPECT_GE(plan.lora_bytes, rows * p.lora_rank_stride * 4);
  if (plan.splits > 1) {
    EXPECT_GE(plan.partial_bytes, rows * plan.splits * p.latent * 4);
    EXPECT_GE(plan.stats_bytes, rows * plan.splits * 2 * 4);
  } else {
    EXPECT_EQ(plan.partial_bytes + plan.stats_bytes, 0u);
  }
  for (size_t b : {plan.latent_bytes, plan.partial_bytes, plan.stats_bytes, plan.lora_bytes}) EXPECT_EQ(b % 256, 0u);
  // One pass fits the budget unless a single token exceeds it.
  if (plan.chunk_tokens > 1) {
    EXPECT_LE(plan.latent_bytes + plan.lora_bytes, kMlaScratchBudget + 512);
  }
}

TEST(MlaPlan, LargeDecodeBatchRunsInOnePassWithoutSplits) {
  const MlaProblem p = deepseek(256, 4096);
  const MlaPlan plan = choose_mla_plan(p);
  expect_consistent(p, plan);
  EXPECT_EQ(plan.chunk_tokens, 256);  // 256 x 128 heads x 512 x 4 B = 64 MiB
  EXPECT_EQ(plan.splits, 1);          // 256 tokens x 2 head groups fill the GPU
  EXPECT_EQ(plan.latent_bytes, size_t{64} << 20);
  EXPECT_EQ(plan.lora_bytes, 0u);
}

TEST(MlaPlan, SingleTokenLongContextIsSplitOverPositions) {
  const MlaProblem p = deepseek(1, 4096);
  const MlaPlan plan = choose_mla_plan(p);
  expect_consistent(p, plan);
  // 2 head groups of 64 want ceil(132 / 2) = 66 splits; 4096 / 128 allows 32: 128 positions each.
  EXPECT_EQ(plan.splits, 32);
  EXPECT_EQ(mla_token_split(4096, plan.splits).chunk, 128);
}

TEST(MlaPlan, ShortContextsAreNotSplit) {
  const MlaProblem p = deepseek(1, 100);
  const MlaPlan plan = choose_mla_plan(p);
  expect_consistent(p, plan);
  EXPECT_EQ(plan.splits, 1);
  EXPECT_EQ(mla_token_split(100, plan.splits).chunk, 128);  // 100 rounded up to whole 64-position tiles
}

TEST(MlaPlan, HeadsPerLatentBlockAreWholeGroupsOf16UpTo64) {
  EXPECT_EQ(mla_heads_per_block(128), 64);
  EXPECT_EQ(mla_heads_per_block(64), 64);
  EXPECT_EQ(mla_heads_per_block(40), 48);
  EXPECT_EQ(mla_heads_per_block(16), 16);
  EXPECT_EQ(mla_heads_per_block(9), 16);
  EXPECT_EQ(mla_heads_per_block(1), 16);
}

TEST(MlaPlan, AbsorptionsTakeNarrowColumnChunksOnlyWhereWideOnesLeaveSmsIdle) {
  // One decode token: the query absorption's 128 heads x 4 wide chunks of R = 512 fill 132 SMs
  // twice; the output absorption's 128 heads x 1 wide chunk of v = 128 would not.
  MlaPlan plan = choose_mla_plan(deepseek(1, 512));
  EXPECT_EQ(plan.query_cols, 128);
  EXPECT_EQ(plan.output_cols, 32);
  // 256 tokens are 4 chunks of 64: 512 wide blocks.
  plan = choose_mla_plan(deepseek(256, 512));
  EXPECT_EQ(plan.query_cols, 128);
  EXPECT_EQ(plan.output_cols, 128);
  // Tensor parallel 8 (16 heads): narrow for both until the tokens make up for the heads.
  MlaProblem tp8 = deepseek(1, 512);
  tp8.heads = 16;
  plan = choose_mla_plan(tp8);
  EXPECT_EQ(plan.query_cols, 32);
  EXPECT_EQ(plan.output_cols, 32);
}

TEST(MlaPlan, ACapturedGraphSizesItsSplitsForTheContextBound) {
  const MlaProblem p = deepseek(1, 16384);  // CudaBackend::kGraphMaxPositions
  const MlaPlan plan = choose_mla_plan(p);
  expect_consistent(p, plan);
  EXPECT_EQ(plan.splits, 64);  // 66 wanted, kMlaMaxSplits allowed
  EXPECT_EQ(mla_token_split(16384, plan.splits).chunk, 256);
  // A short context in that grid uses only the splits it fills, 128 positions or more each: the
  // eager step plans with the same bound (CudaBackend), so it runs these very splits too.
  const MlaTokenSplit short_ctx = mla_token_split(513, plan.splits);
  EXPECT_EQ(short_ctx.count, 5);
  EXPECT_EQ(short_ctx.chunk, 128);
}

TEST(MlaPlan, LongPrefillRunsInPassesUnderTheBudget) {
  const MlaProblem p = deepseek(4096, 4096);
  const MlaPlan plan = choose_mla_plan(p);
  expect_consistent(p, plan);
  EXPECT_EQ(plan.chunk_tokens, 512);  // 128 MiB / 256 KiB per token
  EXPECT_EQ(plan.splits, 1);
  // The LoRA scratch counts too: 128 heads x (512 + 128) x 4 B per token.
  const MlaPlan lora = choose_mla_plan(deepseek(4096, 4096, 128));
  EXPECT_EQ(lora.chunk_tokens, 409);
  EXPECT_EQ(lora.lora_bytes % 256, 0u);
}

TEST(MlaAbsorbedWeights, CopiesOfKvBAreCountedAsTheBackendAllocatesThem) {
  // DeepSeek-V3: 61 layers x 128 heads x 512 latent x (128 nope + 128 v) bf16 = 32 MiB per layer.
  EXPECT_EQ(mla_absorbed_weight_bytes(61, 128, 128, 128, 512), size_t{61} * 32 * 1024 * 1024);
  // Each of the two copies is its own 256-byte-granular allocation (at least 16 bytes).
  EXPECT_EQ(mla_absorbed_weight_bytes(1, 1, 1, 1, 8), size_t{2} * 256);
  EXPECT_EQ(mla_absorbed_weight_bytes(2, 4, 48, 80, 48), size_t{2} * (4 * 48 * 48 * 2 + (4 * 48 * 80 * 2 + 255) / 256 * 256));
  EXPECT_EQ(mla_absorbed_weight_bytes(0, 128, 128, 128, 512), 0u);
}

TEST(MlaPlan, EveryProblemGetsAConsistentPlan) {
  std::mt19937 rng(7);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 2000; ++i) {
    MlaProblem p;
    p.tokens = pick(1, 5000);
    p.heads = pick(1, 160);
    p.latent = pick(1, 512);
    p.v_dim = pick(1, 256);
    p.lora_rank_stride = pick(0, 3) == 0 ? 0 : 1 << pick(0, 7);
    p.max_positions = pick(1, 40000);
    p.num_sms = pick(1, 140);
    expect_consistent(p, choose_mla_plan(p));
  }
}

}  // namespace
}  // namespace moelora::cuda_plan
