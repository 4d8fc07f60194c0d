// The sharding plan: clear refusals of plans the shapes do not allow (including FP8 block
// alignment at published model shapes), what each rank holds, cuts that cover every projection
// exactly once, and adapter shares cut like their weights.
#include <gtest/gtest.h>

#include <map>

#include "lora/adapter.h"
#include "model/archs.h"
#include "parallel/sharding.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

ModelConfig fixture_config(const std::string& arch) {
  auto c = load_model_config(testutil::fixture_path(arch + "/model-bf16"));
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

// Published shapes (config.json of Qwen/Qwen3-30B-A3B-FP8 and deepseek-ai/DeepSeek-V3).
ModelConfig qwen3_30b_a3b_fp8() {
  ModelConfig c = fixture_config("qwen3moe");
  c.hidden_size = 2048, c.num_heads = 32, c.num_kv_heads = 4, c.head_dim = 128;
  c.moe_intermediate_size = 768, c.intermediate_size = 6144, c.num_experts = 128, c.top_k = 8;
  c.weight_format = WeightFormat::fp8_block(128, 128);
  return c;
}
ModelConfig deepseek_v3() {
  ModelConfig c = fixture_config("deepseekv3");
  c.hidden_size = 7168, c.num_heads = 128, c.q_lora_rank = 1536, c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128, c.qk_rope_head_dim = 64, c.v_head_dim = 128;
  c.intermediate_size = 18432, c.moe_intermediate_size = 2048, c.num_experts = 256, c.n_shared_experts = 1;
  c.weight_format = WeightFormat::fp8_block(128, 128);
  return c;
}

void expect_refused(const Status& s, const std::string& words) {
  ASSERT_FALSE(s.ok()) << "expected a refusal mentioning: " << words;
  EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
}

TEST(ValidatePlan, ShapesThatDoNotDivideAreRefusedNamingTheShape) {
  const ModelConfig q = fixture_config("qwen3moe");  // 4 heads, 2 KV heads, 8 experts of width 192
  EXPECT_TRUE(validate_plan(q, 4, 4).ok());          // KV heads replicated over 2 ranks each
  expect_refused(validate_plan(q, 3, 1), "--tp 3 does not divide the model's 4 attention heads");
  expect_refused(validate_plan(q, 1, 9), "--ep 9 is more ranks than the model's 8 routed experts");
  expect_refused(validate_plan(q, 0, 1), "at least 1");
  ModelConfig odd_kv = q;
  odd_kv.num_heads = 12, odd_kv.num_kv_heads = 3;
  expect_refused(validate_plan(odd_kv, 2, 1), "--tp 2 neither divides the model's 3 KV heads");
  ModelConfig narrow = q;
  narrow.moe_intermediate_size = 102;
  expect_refused(validate_plan(narrow, 4, 1), "--tp 4 does not divide the experts' intermediate size 102");
  ModelConfig dense = q;
  dense.layer_is_moe = {false, true};
  dense.intermediate_size = 250;
  expect_refused(validate_plan(dense, 4, 1), "dense MLP's intermediate size 250");
  dense.layer_is_moe = {false, false};
  dense.intermediate_size = 256;
  expect_refused(validate_plan(dense, 1, 2), "no routed experts");
  // EP ranks need not divide the expert count: 8 experts over 3 ranks is 2 + 3 + 3.
  EXPECT_TRUE(validate_plan(q, 1, 3).ok());
}

// On the GPU the weights stay FP8 with one scale per 128x128 block, so a cut must fall on block
// boundaries. Qwen3-30B-A3B's experts are 768 wide: 384 per rank at tp 2, but 192 at tp 4 (the
// failure vLLM and sglang users meet); EP does not cut experts, so tp 2 x ep 4 serves 8 GPUs.
TEST(ValidatePlan, Fp8BlockAlignmentAtPublishedShapes) {
  const ModelConfig q = qwen3_30b_a3b_fp8();
  EXPECT_TRUE(validate_plan(q, 2, 4, /*fp8_block_aligned=*/true).ok());
  expect_refused(validate_plan(q, 4, 1, true), "expert intermediate per rank is 192, not a multiple of the FP8 block");
  expect_refused(validate_plan(q, 8, 1, true), "expert intermediate per rank is 96");
  EXPECT_TRUE(validate_plan(q, 4, 1, /*fp8_block_aligned=*/false).ok());  // the CPU holds dequantised float32
  const ModelConfig d = deepseek_v3();
  EXPECT_TRUE(validate_plan(d, 8, 1, true).ok());
  EXPECT_TRUE(validate_plan(d, 2, 4, true).ok());
  EXPECT_TRUE(validate_plan(d, 16, 1, true).ok());
  expect_refused(validate_plan(d, 32, 1, true), "dense MLP intermediate per rank is 576");
}

TEST(RankLayout, GridHeadsKvReplicationExpertsAndVocabulary) {
  const ModelConfig q = fixture_config("qwen3moe");
  // tp 4 over 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1; one query head each.
  for (int r = 0; r < 4; ++r) {
    auto l = make_rank_layout(q, {4, 1, r});
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->local.num_heads, 1);
    EXPECT_EQ(l->q_head_begin, r);
    EXPECT_EQ(l->local.num_kv_heads, 1);
    EXPECT_EQ(l->kv_head_begin, r / 2);
    EXPECT_EQ(l->local.moe_intermediate_size, 48);
    EXPECT_EQ(l->moe_inter_begin, 48 * r);
    EXPECT_EQ(l->vocab_begin, 64 * r);
    EXPECT_EQ(l->vocab_chunk, 64);
  }
  // 8 experts over 3 EP ranks: [0, 2), [2, 5), [5, 8).
  const int begins[3] = {0, 2, 5}, counts[3] = {2, 3, 3};
  for (int r = 0; r < 3; ++r) {
    auto l = make_rank_layout(q, {1, 3, r});
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->expert_begin, begins[r]);
    EXPECT_EQ(l->local.num_experts, counts[r]);
  }
  // The grid: rank = ep_rank * tp + tp_rank.
  auto l = make_rank_layout(q, {2, 2, 3});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->plan.tp_rank(), 1);
  EXPECT_EQ(l->plan.ep_rank(), 1);
  EXPECT_EQ(l->expert_begin, 4);
  EXPECT_EQ(l->q_head_begin, 2);
  EXPECT_FALSE(make_rank_layout(q, {2, 2, 4}).ok());
}

// Across one TP group, column cuts cover every output row and row cuts every input column
// exactly once (a replicated KV head: tp / kv_heads times); replicated projections stay whole.
TEST(ProjectionCut, EveryProjectionIsCoveredExactlyOncePerTpGroup) {
  for (const char* arch : {"qwen3moe", "mixtral", "deepseekv3"}) {
    const ModelConfig cfg = fixture_config(arch);
    for (int tp : {2, 4}) {
      for (int layer = 0; layer < cfg.num_layers; ++layer)
        for (int t = 0; t < kNumLoraTargets; ++t) {
          const auto target = static_cast<LoraTarget>(t);
          const auto [in, out] = lora_target_shape(cfg, layer, target);
          if (in == 0) continue;
          std::map<int64_t, int> covered;
          ProjectionCut::Kind kind = ProjectionCut::Kind::kReplicated;
          for (int r = 0; r < tp; ++r) {
            auto l = make_rank_layout(cfg, {tp, 1, r});
            ASSERT_TRUE(l.ok());
            const ProjectionCut cut = projection_cut(cfg, *l, target);
            kind = cut.kind;
            for (int64_t i = cut.begin; i < cut.begin + cut.count; ++i) covered[i]++;
          }
          const std::string what = std::string(arch) + " tp " + std::to_string(tp) + " " + lora_target_name(target);
          if (kind == ProjectionCut::Kind::kReplicated) {
            EXPECT_TRUE(target == LoraTarget::kQA || target == LoraTarget::kKVA) << what;
            continue;
          }
          const int64_t extent = kind == ProjectionCut::Kind::kColumn ? out : in;
          const bool kv = target == LoraTarget::kK || target == LoraTarget::kV;
          const int times = kv && cfg.num_kv_heads < tp ? tp / cfg.num_kv_heads : 1;
          EXPECT_EQ(static_cast<int64_t>(covered.size()), extent) << what;
          for (const auto& [i, n] : covered) EXPECT_EQ(n, times) << what << " index " << i;
        }
    }
  }
}

// An adapter's share: ranks kept, dense factors cut like their projections, routed-expert factors
// of the rank's experts with the intermediate slice of each.
TEST(ShardAdapter, FactorsAreCutLikeTheirWeights) {
  const ModelConfig cfg = fixture_config("deepseekv3");
  const std::string dir = testutil::fixture_path("deepseekv3/adapters/full-r16");
  auto full = load_lora_adapter(dir, "full-r16", cfg);
  ASSERT_TRUE(full.ok()) << full.status().message();
  const int tp = 2, ep = 2, I = cfg.moe_intermediate_size, il = I / tp;
  auto l = make_rank_layout(cfg, {tp, ep, 3});  // tp_rank 1, ep_rank 1
  ASSERT_TRUE(l.ok());
  auto share = shard_adapter(cfg, **full, *l);
  const int moe_layer = 1;
  const ExpertLora& fx = (*full)->experts[moe_layer];
  const ExpertLora& sx = share->experts[moe_layer];
  ASSERT_GT(fx.gu_rank, 0);
  ASSERT_GT(fx.d_rank, 0);
  EXPECT_EQ(sx.gu_rank, fx.gu_rank);
  EXPECT_EQ(sx.gu_b.shape(), (std::vector<int64_t>{4, 2 * il, fx.gu_rank}));
  EXPECT_EQ(sx.d_a.shape(), (std::vector<int64_t>{4, fx.d_rank, il}));
  EXPECT_EQ(sx.d_b.shape(), (std::vector<int64_t>{4, cfg.hidden_size, fx.d_rank}));
  // Local expert 1 = global expert 5; its up half starts at row I + il of the full factor.
  const int r = fx.gu_rank;
  EXPECT_EQ(sx.gu_b.ptr<float>()[(1 * 2 * il + il) * r], fx.gu_b.ptr<float>()[(5 * 2 * I + I + il) * r]);
  EXPECT_EQ(sx.d_a.ptr<float>()[(1 * fx.d_rank) * il + 3], fx.d_a.ptr<float>()[(5 * fx.d_rank) * I + il + 3]);
  // o_proj: A keeps the rank's input columns (heads 2, 3), B stays whole.
  const LoraFactor& fo = (*full)->dense[moe_layer][static_cast<int>(LoraTarget::kO)];
  const LoraFactor& so = share->dense[moe_layer][static_cast<int>(LoraTarget::kO)];
  ASSERT_GT(fo.rank, 0);
  EXPECT_EQ(so.a.dim(1), fo.a.dim(1) / tp);
  EXPECT_EQ(so.b.data(), fo.b.data());
  EXPECT_EQ(so.a.ptr<float>()[0], fo.a.ptr<float>()[fo.a.dim(1) / tp]);
  // kv_a is replicated (shared by all heads): the same tensors.
  const LoraFactor& fk = (*full)->dense[moe_layer][static_cast<int>(LoraTarget::kKVA)];
  EXPECT_EQ(share->dense[moe_layer][static_cast<int>(LoraTarget::kKVA)].a.data(), fk.a.data());
}

}  // namespace
}  // namespace moelora
