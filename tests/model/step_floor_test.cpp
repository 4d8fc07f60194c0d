// The floors the benchmarks divide by (model/step_floor.h): each term checked against the shapes of
// the bench configs, written out by hand.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "model/model_config.h"
#include "model/step_floor.h"

namespace moelora {
namespace {

ModelConfig bench_config(const std::string& name) {
  std::ifstream f(std::string(MOELORA_SOURCE_DIR) + "/bench/configs/" + name);
  std::stringstream text;
  text << f.rdbuf();
  auto cfg = parse_model_config(text.str(), name);
  EXPECT_TRUE(cfg.ok()) << cfg.status().message();
  return *cfg;
}

TEST(StepFloor, DistinctExpertsRunFromTopKToAllExperts) {
  const ModelConfig c = bench_config("qwen3-30b-a3b-fp8.json");  // 128 experts, top-8
  EXPECT_DOUBLE_EQ(expected_distinct_experts(c, 1), 8.0);
  EXPECT_NEAR(expected_distinct_experts(c, 2), 128.0 * (1 - (120.0 / 128) * (120.0 / 128)), 1e-9);
  EXPECT_LT(expected_distinct_experts(c, 64), 128.0);
  EXPECT_GT(expected_distinct_experts(c, 256), 127.0);
}

// Qwen3-30B-A3B (no shared experts): the bf16 router, 8 FP8 experts of gate|up and down at one
// token; one adapter at one token adds its factors of those 8 experts, r (2H + 3I) values each.
TEST(StepFloor, MoeBlockOfOneTokenIsRouterTopKExpertsAndTheirLora) {
  const ModelConfig c = bench_config("qwen3-30b-a3b-fp8.json");
  const double H = 2048, I = 768, E = 128, wb = c.weight_format.bytes_per_weight();
  ASSERT_GE(wb, 1.0);
  ASSERT_LT(wb, 1.01);  // FP8 plus its 128 x 128 block scales
  const double base = 2 * E * H + 8 * 3 * H * I * wb;
  EXPECT_DOUBLE_EQ(moe_block_floor_bytes(c, 0, 1, 0, 16), base);
  EXPECT_DOUBLE_EQ(moe_block_floor_bytes(c, 0, 1, 1, 16), base + 8 * 2.0 * 16 * (2 * H + 3 * I));
  // More adapters than tokens read no more factors than one adapter per token.
  EXPECT_DOUBLE_EQ(moe_block_floor_bytes(c, 0, 1, 8, 16), moe_block_floor_bytes(c, 0, 1, 1, 16));
  // 8 adapters over 64 tokens touch 8 x D(8) (adapter, expert) pairs: more than one adapter's D(64).
  EXPECT_GT(moe_block_floor_bytes(c, 0, 64, 8, 16), moe_block_floor_bytes(c, 0, 64, 1, 16));
}

// DeepSeek-V3's shared expert (gate, up: H -> 2048, down: 2048 -> H) is in its MoE block's floor,
// weights and LoRA factors; the first layers are dense, and a dense layer has no MoE block.
TEST(StepFloor, MoeBlockCountsTheSharedExpert) {
  const ModelConfig c = bench_config("deepseek-v3-fp8.json");
  const double H = 7168, I = 2048, E = 256, wb = c.weight_format.bytes_per_weight();
  const int moe_layer = 3;
  ASSERT_TRUE(c.layer_is_moe[moe_layer]);
  const double routed = 2 * E * H + 8 * 3 * H * I * wb;
  const double shared = 3 * H * I * wb;
  EXPECT_NEAR(moe_block_floor_bytes(c, moe_layer, 1, 0, 16), routed + shared, 1e-6 * routed);
  const double shared_lora = 2.0 * 16 * ((H + I) * 3);
  const double routed_lora = 8 * 2.0 * 16 * (2 * H + 3 * I);
  EXPECT_NEAR(moe_block_floor_bytes(c, moe_layer, 1, 1, 16), routed + shared + routed_lora + shared_lora,
              1e-6 * routed);
  EXPECT_DEATH(moe_block_floor_bytes(c, 0, 1, 0, 16), "not a MoE layer");
}

// The step's floor grows by exactly the KV bytes with the context, and holds every MoE block.
TEST(StepFloor, DecodeStepHoldsItsMoeBlocksAndTheCache) {
  ModelConfig c = bench_config("qwen3-30b-a3b-fp8.json");
  const KvShape kv = kv_shape(c, false);
  const double per_token_layer = kv.values_per_token() * 2.0;
  EXPECT_DOUBLE_EQ(decode_step_floor_bytes(c, kv, 4, 2, 16, 100) - decode_step_floor_bytes(c, kv, 4, 2, 16, 0),
                   4 * 100 * c.num_layers * per_token_layer);
  double blocks = 0;
  for (int l = 0; l < c.num_layers; ++l) blocks += moe_block_floor_bytes(c, l, 4, 2, 16);
  EXPECT_GT(decode_step_floor_bytes(c, kv, 4, 2, 16, 0), blocks + 2.0 * c.vocab_size * c.hidden_size);
}

// Qwen3-30B-A3B's attention (32 query heads, 4 KV heads of 128, hidden 2048): q|k|v and o in FP8,
// r (in + out) bf16 values per target and adapter, the cache read over the context and the step's
// own K and V written.
TEST(StepFloor, AttentionBlockIsProjectionsTheirLoraAndTheCache) {
  const ModelConfig c = bench_config("qwen3-30b-a3b-fp8.json");
  const KvShape kv = kv_shape(c, false);
  const double H = 2048, q = 32 * 128, k = 4 * 128, wb = c.weight_format.bytes_per_weight();
  const double weights = (H * (q + 2 * k) + q * H) * wb;
  const double per_position = 2.0 * k * 2.0;  // K and V, bf16
  ASSERT_DOUBLE_EQ(kv.values_per_token() * 2.0, per_position);
  EXPECT_NEAR(attention_block_floor_bytes(c, kv, 0, 1, 0, 16, 0), weights + per_position, 1e-9 * weights);
  const double lora = 2.0 * 16 * ((H + q) + 2 * (H + k) + (q + H));
  EXPECT_NEAR(attention_block_floor_bytes(c, kv, 0, 1, 1, 16, 0), weights + lora + per_position, 1e-9 * weights);
  // More adapters than tokens read no more factors; 64 sequences of 512 positions read 64 x 512.
  EXPECT_DOUBLE_EQ(attention_block_floor_bytes(c, kv, 0, 1, 8, 16, 0), attention_block_floor_bytes(c, kv, 0, 1, 1, 16, 0));
  EXPECT_NEAR(attention_block_floor_bytes(c, kv, 0, 64, 0, 16, 512), weights + 64 * 513 * per_position,
              1e-9 * weights);
  // The decode step holds every layer's attention block (with the cache) and every MoE block.
  double blocks = 2.0 * c.vocab_size * c.hidden_size;
  for (int l = 0; l < c.num_layers; ++l)
    blocks += attention_block_floor_bytes(c, kv, l, 4, 2, 16, 100) + moe_block_floor_bytes(c, l, 4, 2, 16);
  // The step floor counts the cache read only (context), the blocks its write too (context + 1).
  EXPECT_NEAR(decode_step_floor_bytes(c, kv, 4, 2, 16, 100), blocks - 4 * c.num_layers * per_position, 1e-9 * blocks);
}

}  // namespace
}  // namespace moelora
