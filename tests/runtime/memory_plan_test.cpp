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
  EXPECT_EQ(kv_page_bytes(c, kv_shape(c, false), 16, 2), 2u * 16 * 2 * (16 + 16) * 2);
  // The MLA form means nothing to a GQA model: its cache is the same either way.
  EXPECT_EQ(kv_page_bytes(c, kv_shape(c, true), 16, 2), kv_page_bytes(c, kv_shape(c, false), 16, 2));
}

// DeepSeek-V3's shapes: the absorbed form caches kv_lora_rank + rope values per token and layer
// (the latent c and k_pe), the decompressed form heads x (nope + rope + v); the KV cache a memory
// budget holds grows by their ratio.
TEST(MemoryPlan, MlaAbsorbedCachesTheLatentPerToken) {
  ModelConfig c;
  c.arch = Arch::kDeepseekV3;
  c.num_layers = 61;
  c.num_heads = 128;
  c.num_kv_heads = 128;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.kv_lora_rank = 512;
  const size_t bf16 = 2;
  const KvShape latent = kv_shape(c, true), full = kv_shape(c, false);
  EXPECT_EQ(latent.kv_heads, 1);
  EXPECT_EQ(latent.k_head_dim, 512 + 64);
  EXPECT_EQ(latent.v_head_dim, 0);
  EXPECT_EQ(latent.values_per_token(), 576);
  EXPECT_EQ(full.values_per_token(), 128 * (128 + 64 + 128));  // 40960
  // Per token (a page of one position): layers x (kv_lora_rank + rope) x bytes.
  EXPECT_EQ(kv_page_bytes(c, latent, 1, bf16), 61u * (512 + 64) * bf16);
  EXPECT_EQ(kv_page_bytes(c, full, 1, bf16), 61u * 128 * (128 + 64 + 128) * bf16);
  EXPECT_EQ(kv_page_bytes(c, latent, 16, 4), 16u * 61 * 576 * 4);

  // The same budget: the latent cache holds 40960 / 576 = 71.1x the tokens.
  MemoryInputs in = h200_like();
  in.pages_per_sequence = 8;
  in.page_bytes = kv_page_bytes(c, full, 16, bf16);
  auto decompressed = plan_memory(in);
  in.page_bytes = kv_page_bytes(c, latent, 16, bf16);
  auto absorbed = plan_memory(in);
  ASSERT_TRUE(decompressed.ok() && absorbed.ok());
  const size_t for_kv = static_cast<size_t>(0.9 * 140 * kGiB) - 40 * kGiB - 6 * kGiB;
  EXPECT_EQ(decompressed->kv_pages, static_cast<int>(for_kv / kv_page_bytes(c, full, 16, bf16)));
  EXPECT_EQ(absorbed->kv_pages, static_cast<int>(for_kv / kv_page_bytes(c, latent, 16, bf16)));
  const double ratio = static_cast<double>(absorbed->kv_pages) / decompressed->kv_pages;
  EXPECT_NEAR(ratio, 40960.0 / 576.0, 0.1);  // whole pages: ~1e3 decompressed pages round by < 1e-3
}

}  // namespace
}  // namespace moelora
