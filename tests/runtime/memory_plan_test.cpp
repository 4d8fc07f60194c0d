// Start-up memory sizing (runtime/memory_plan.h): the arithmetic, and refusals that say what to
// change, without a GPU.
#include <gtest/gtest.h>

#include "model/archs.h"
#include "runtime/memory_plan.h"

namespace moelora {
namespace {

constexpr size_t kGiB = 1ull << 30;

MemoryInputs h200_like() {
  MemoryInputs in;
  in.device_total = 140 * kGiB;
  in.device_free = 100 * kGiB;  // 40 GiB in use: weights, scratch
  in.utilization = 0.9;
  in.adapter_reserve = 6 * kGiB;
  in.page_bytes = 3 * (1u << 20);  // 3 MiB a page
  in.pages_per_sequence = 2048;    // 6 GiB a sequence
  return in;
}

TEST(MemoryPlan, KvGetsWhatUtilizationLeavesAfterUseAndAdapters) {
  auto p = plan_memory(h200_like());
  ASSERT_TRUE(p.ok()) << p.status().message();
  const size_t allowed = static_cast<size_t>(0.9 * 140 * kGiB);
  const size_t for_kv = allowed - 40 * kGiB - 6 * kGiB;
  EXPECT_EQ(p->kv_pages, static_cast<int>(for_kv / (3u << 20)));
  EXPECT_LE(p->kv_bytes, for_kv);
  EXPECT_GT(p->kv_bytes + (3u << 20), for_kv);
  EXPECT_NE(p->summary.find("GiB KV cache"), std::string::npos);
}

TEST(MemoryPlan, RefusesWhenOneSequenceDoesNotFit) {
  MemoryInputs in = h200_like();
  in.utilization = 0.35;  // 49 GiB allowed, 40 in use, 6 for adapters: 3 GiB < 6 GiB a sequence
  auto p = plan_memory(in);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), ErrorCode::kResourceExhausted);
  for (const char* hint : {"--gpu-memory-utilization", "--max-model-len", "--max-lora-rank"})
    EXPECT_NE(p.status().message().find(hint), std::string::npos) << hint;
}

TEST(MemoryPlan, ExplicitPagesMustFit) {
  MemoryInputs in = h200_like();
  in.kv_pages_override = 1000;
  auto ok = plan_memory(in);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->kv_pages, 1000);
  in.kv_pages_override = 1 << 20;  // 3 TiB
  auto bad = plan_memory(in);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--kv-cache-pages"), std::string::npos);
}

TEST(MemoryPlan, UtilizationOutOfRangeIsRefused) {
  MemoryInputs in = h200_like();
  in.utilization = 1.5;
  EXPECT_FALSE(plan_memory(in).ok());
}

TEST(MemoryPlan, SlotAndPageBytesCountEveryTarget) {
  ModelConfig c;
  c.arch = Arch::kQwen3Moe;
  c.num_layers = 2;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 128;
  c.moe_intermediate_size = 32;
  c.num_experts = 8;
  c.top_k = 2;
  c.layer_is_moe = {true, true};
  size_t dense = 0;
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < kNumLoraTargets; ++t) {
      auto [in, out] = lora_target_shape(c, l, static_cast<LoraTarget>(t));
      dense += static_cast<size_t>(in + out);
    }
  const size_t experts = 2 * 8 * (64 + 64 + 32 + 64);  // per layer: E x (H + 2I + I + H)
  EXPECT_EQ(adapter_slot_bytes(c, 4), 4 * 2 * (dense + experts));
  EXPECT_EQ(kv_page_bytes(c, 16, 2), 2u * 16 * 2 * (16 + 16) * 2);
}

}  // namespace
}  // namespace moelora
