// The CUDA kernels' limits on model shapes, checked on the host: every model the repository ships
// or benchmarks passes, and each limit alone refuses with a message that names it (one violation
// per test, so a limit that stops firing, or fires for the wrong reason, fails here).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "backends/cuda_plan/shape_limits.h"
#include "model/model.h"
#include "model/model_config.h"

namespace moelora::cuda_plan {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ModelConfig parse(const std::string& text, const std::string& what) {
  auto cfg = parse_model_config(text, what);
  EXPECT_TRUE(cfg.ok()) << cfg.status().to_string();
  return cfg.ok() ? *cfg : ModelConfig{};
}

ModelShapes shapes_of(const fs::path& config_json) {
  return model_shapes(parse(read_text(config_json), config_json.string()));
}

const fs::path kSource = MOELORA_SOURCE_DIR;

// Qwen3-30B-A3B (bench/configs): the shapes every single-limit test below starts from.
ModelShapes qwen3_30b() { return shapes_of(kSource / "bench" / "configs" / "qwen3-30b-a3b-fp8.json"); }
// The DeepSeek-V3 tiny fixture (MLA, grouped router, shared experts) with edits to its config.
ModelShapes deepseek_fixture(const std::function<void(nlohmann::json&)>& edit = {}) {
  const fs::path p = kSource / "tests" / "fixtures" / "deepseekv3" / "model-bf16" / "config.json";
  nlohmann::json j = nlohmann::json::parse(read_text(p));
  if (edit) edit(j);
  return model_shapes(parse(j.dump(), p.string()));
}

// Exactly one violation, containing every fragment.
void expect_one(const ModelShapes& s, const std::vector<std::string>& fragments) {
  const std::vector<std::string> v = shape_limit_violations(s);
  ASSERT_EQ(v.size(), 1u) << (v.empty() ? "accepted" : ::testing::PrintToString(v));
  for (const std::string& f : fragments) EXPECT_NE(v[0].find(f), std::string::npos) << "'" << f << "' not in: " << v[0];
  const Status st = check_shape_limits(s);
  EXPECT_EQ(st.code(), ErrorCode::kUnsupported);
  EXPECT_NE(st.message().find(v[0]), std::string::npos);
}

void expect_ok(const ModelShapes& s) {
  EXPECT_TRUE(shape_limit_violations(s).empty()) << ::testing::PrintToString(shape_limit_violations(s));
  EXPECT_TRUE(check_shape_limits(s).ok());
}

TEST(ShapeLimits, EveryBundledAndBenchmarkedModelIsAccepted) {
  std::vector<fs::path> configs;
  for (const auto& arch : fs::directory_iterator(kSource / "tests" / "fixtures"))
    if (arch.is_directory())
      for (const auto& m : fs::directory_iterator(arch.path()))
        if (fs::exists(m.path() / "config.json")) configs.push_back(m.path() / "config.json");
  const size_t fixtures = configs.size();
  for (const auto& c : fs::directory_iterator(kSource / "bench" / "configs"))
    if (c.path().extension() == ".json") configs.push_back(c.path());
  configs.push_back(kSource / "models" / "tiny-qwen3moe" / "config.json");
  EXPECT_GE(fixtures, 6u);  // qwen3moe, mixtral, deepseekv3 in bf16 and fp8
  EXPECT_GE(configs.size() - fixtures, 4u);
  for (const fs::path& p : configs) {
    SCOPED_TRACE(p.string());
    ModelShapes s = shapes_of(p);
    expect_ok(s);
    // ... and with the adapter capacity the engine checks on CUDA (default slots, the rank cap).
    s.lora_slots = 8;
    s.max_lora_rank = kMaxLoraRank;
    expect_ok(s);
  }
}

TEST(ShapeLimits, ShapesComeFromTheConfigAsTheForwardPassUsesThem) {
  const ModelShapes d = deepseek_fixture();
  EXPECT_EQ(d.arch, "deepseek_v3");
  EXPECT_EQ(d.k_head_dim, 48);  // qk_nope 32 + qk_rope 16: the decompressed MLA head
  EXPECT_EQ(d.v_head_dim, 32);
  EXPECT_EQ(d.kv_heads, d.heads);
  EXPECT_EQ(d.rope_dim, 16);
  EXPECT_EQ(d.rope_offset, 32);
  EXPECT_TRUE(d.grouped_router);
  EXPECT_EQ(d.n_group, 2);
  auto has_input = [&](const std::string& name, int in) {
    for (const auto& x : d.lora_inputs)
      if (x.name == name && x.in == in) return true;
    return false;
  };
  EXPECT_TRUE(has_input("q_b_proj", 96));    // q_lora_rank
  EXPECT_TRUE(has_input("kv_b_proj", 64));   // kv_lora_rank
  EXPECT_TRUE(has_input("o_proj", 4 * 32));  // heads * v_head_dim
  EXPECT_TRUE(has_input("shared_experts.down_proj", 192));
  EXPECT_EQ(d.kv_lora_rank, 64);
  EXPECT_FALSE(d.mla_absorbed);  // the form is the caller's: model_shapes(cfg, absorbed)
  EXPECT_TRUE(model_shapes(parse(read_text(kSource / "tests" / "fixtures" / "deepseekv3" / "model-bf16" / "config.json"),
                                 "deepseek"),
                           true)
                  .mla_absorbed);
  const ModelShapes q = qwen3_30b();
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.top_k, 8);
  EXPECT_EQ(q.moe_intermediate, 768);
  EXPECT_EQ(q.weight_format, WeightFormat::fp8_block(128, 128));
  EXPECT_EQ(q.lora_slots, 0);  // the engine adds its capacity
}

TEST(ShapeLimits, AttentionHeadDimsBeyondTheGenericKernelAreRefused) {
  ModelShapes s = qwen3_30b();
  s.k_head_dim = 264;
  s.v_head_dim = 128;
  s.rope_dim = 64;  // still inside the head: only the attention kernels object
  expect_one(s, {"attention", "head dims k=264, v=128", "multiple of 8", "at most 256"});
  s.k_head_dim = 68;  // not a multiple of 8: the generic kernel reads K rows in 16-byte pieces
  expect_one(s, {"attention", "head dims k=68, v=128"});
  s.k_head_dim = 128;
  s.v_head_dim = 272;
  expect_one(s, {"attention", "head dims k=128, v=272"});
}

TEST(ShapeLimits, AnyHeadDimsUpTo256AreAcceptedAndTheKernelIsChosenByPair) {
  for (const HeadDims& d : kTensorCoreHeadDims) {
    ModelShapes s = qwen3_30b();
    s.k_head_dim = d.k;
    s.v_head_dim = d.v;
    s.rope_dim = d.k - 16;  // fits
    expect_ok(s);
    EXPECT_EQ(choose_attention_kernel(d.k, d.v), AttentionKernel::kTensorCore);
  }
  // Every multiple of 16 up to 256 for k and v, k != v included (the range): some kernel.
  for (int k = 16; k <= 256; k += 16)
    for (int v = 16; v <= 256; v += 16) {
      ModelShapes s = qwen3_30b();
      s.k_head_dim = k;
      s.v_head_dim = v;
      s.rope_dim = k;
      expect_ok(s);
      EXPECT_NE(choose_attention_kernel(k, v), AttentionKernel::kUnsupported) << k << "/" << v;
    }
  EXPECT_EQ(choose_attention_kernel(128, 64), AttentionKernel::kGeneric);
  EXPECT_EQ(choose_attention_kernel(96, 96), AttentionKernel::kGeneric);
  EXPECT_EQ(choose_attention_kernel(256, 256), AttentionKernel::kGeneric);
  EXPECT_EQ(choose_attention_kernel(40, 24), AttentionKernel::kGeneric);
  EXPECT_EQ(choose_attention_kernel(36, 32), AttentionKernel::kUnsupported);
  EXPECT_EQ(choose_attention_kernel(0, 32), AttentionKernel::kUnsupported);
}

TEST(ShapeLimits, QueryHeadsMustBeAMultipleOfKvHeads) {
  ModelShapes s = qwen3_30b();
  s.heads = 30;
  s.kv_heads = 4;
  expect_one(s, {"attention", "30 query heads", "4 kv heads"});
}

TEST(ShapeLimits, RotaryDimsMustBeEvenAndInsideTheHead) {
  ModelShapes s = qwen3_30b();
  s.rope_dim = 63;
  expect_one(s, {"rope", "63 rotary dims", "even"});
  s.rope_dim = 32;
  s.rope_offset = 112;  // 112 + 32 > 128
  expect_one(s, {"rope", "offset 112", "128-dim head"});
}

TEST(ShapeLimits, HiddenSizeNotAMultipleOf64IsRefused) {
  ModelShapes s = qwen3_30b();
  s.hidden = 2048 + 16;  // multiples of 16 run (the generic expert GEMMs)
  for (auto& in : s.lora_inputs)
    if (in.in == 2048) in.in = s.hidden;
  expect_ok(s);
  s.hidden = 2048 + 8;  // still a multiple of 8: only the expert GEMMs object
  for (auto& in : s.lora_inputs)
    if (in.in == 2064) in.in = s.hidden;
  expect_one(s, {"MoE experts", "hidden_size 2056", "multiple of 16"});
}

TEST(ShapeLimits, ExpertIntermediateNotAMultipleOf16IsRefused) {
  ModelShapes s = qwen3_30b();
  s.moe_intermediate = 768 + 16;
  expect_ok(s);
  s.moe_intermediate = 768 + 8;
  expect_one(s, {"MoE experts", "intermediate size 776", "multiple of 16"});
}

TEST(ShapeLimits, MoeLimitsDoNotApplyWithoutExperts) {
  ModelShapes s = qwen3_30b();
  s.num_experts = 0;
  s.hidden = 2056;
  s.moe_intermediate = 776;
  s.top_k = 0;
  s.lora_slots = 100000;
  expect_ok(s);
}

TEST(ShapeLimits, TooManyExpertsForTheRouterAreRefused) {
  ModelShapes s = qwen3_30b();
  s.num_experts = 1024;
  expect_ok(s);
  s.num_experts = 1025;
  expect_one(s, {"router", "1025 routed experts", "at most 1024"});
}

TEST(ShapeLimits, TopKAbove32IsRefused) {
  ModelShapes s = qwen3_30b();
  s.top_k = 32;
  expect_ok(s);
  s.top_k = 33;
  expect_one(s, {"router", "33 experts per token", "1..32"});
}

TEST(ShapeLimits, GroupLimitedRoutingBeyondTheRouterIsRefused) {
  ModelShapes s = deepseek_fixture();
  expect_ok(s);
  s.num_experts = 256;
  s.n_group = 64;  // one lane per group: at most 32
  s.topk_group = 4;
  expect_one(s, {"router", "n_group 64", "1..32 equal groups"});
  s.n_group = 8;
  s.topk_group = 0;
  expect_one(s, {"router", "topk_group 0"});
  s.topk_group = 4;
  s.num_experts = 260;  // not 8 equal groups
  expect_one(s, {"router", "over 260 experts"});
  // Softmax routers ignore the groups.
  s.grouped_router = false;
  expect_ok(s);
}

TEST(ShapeLimits, AdapterSlotsTimesExpertsBeyondTheMoeAlignmentAreRefused) {
  // The bucket bound: (slots * E + 1) <= 12288 groups. DeepSeek-V3 has 256 experts.
  ModelShapes s = deepseek_fixture();
  s.num_experts = 256;
  s.top_k = 8;
  s.n_group = 8;
  s.topk_group = 4;
  EXPECT_EQ(moe_lora_max_slots(256), 47);
  s.lora_slots = 47;
  expect_ok(s);
  s.lora_slots = 48;
  expect_one(s, {"MoE LoRA", "48 adapter slots x 256 experts", "at most 47 slots"});
  // With few experts the shared memory binds first: 1463 x 8 + 1 buckets is below 12288, but
  // 4 * (4 * 11705 + 3 * 1463) bytes exceed 200 KiB.
  ModelShapes m = shapes_of(kSource / "tests" / "fixtures" / "mixtral" / "model-bf16" / "config.json");
  m.num_experts = 8;
  EXPECT_EQ(moe_lora_max_slots(8), 1462);
  m.lora_slots = 1462;
  expect_ok(m);
  m.lora_slots = 1463;
  expect_one(m, {"MoE LoRA", "1463 adapter slots", "at most 1462 slots"});
}

TEST(ShapeLimits, Fp8BlocksOtherThan128By128AreRefused) {
  ModelShapes s = qwen3_30b();
  s.weight_format = WeightFormat::fp8_block(64, 128);  // the expert GEMMs index scales by 128-row blocks
  expect_one(s, {"FP8", "weight_block_size [64, 128]", "[128, 128]"});
  s.weight_format = WeightFormat::fp8_block(128, 64);  // the dense kernels need 128-wide column blocks as well
  expect_one(s, {"FP8", "weight_block_size [128, 64]"});
  // Without experts only the column block matters; without FP8 nothing does.
  s.num_experts = 0;
  expect_one(s, {"FP8", "[any, 128]"});
  s.weight_format = WeightFormat::fp8_block(64, 128);
  expect_ok(s);
  s.weight_format = WeightFormat::dense();
  expect_ok(s);
  s.weight_format = WeightFormat::nvfp4();  // served as bf16 on the GPU for now: no block constraint
  expect_ok(s);
}

TEST(ShapeLimits, VocabularyOf2To24TokensIsRefused) {
  ModelShapes s = qwen3_30b();
  s.vocab = (1 << 24) - 1;
  expect_ok(s);
  s.vocab = 1 << 24;
  expect_one(s, {"sampling", "vocab_size 16777216", "2^24"});
}

TEST(ShapeLimits, LoraTargetWithAnInputWidthNotAMultipleOf8IsRefused) {
  // A DeepSeek model whose q_lora_rank (q_b_proj's input) is 100: the real config path.
  const ModelShapes s = deepseek_fixture([](nlohmann::json& j) { j["q_lora_rank"] = 100; });
  expect_one(s, {"LoRA", "q_b_proj", "input width 100", "multiple of 8"});
  expect_ok(deepseek_fixture([](nlohmann::json& j) { j["q_lora_rank"] = 104; }));
}

TEST(ShapeLimits, AdapterRankAbove128IsRefused) {
  ModelShapes s = qwen3_30b();
  s.max_lora_rank = 128;
  expect_ok(s);
  s.max_lora_rank = 256;
  expect_one(s, {"LoRA", "rank up to 256", "up to 128"});
}

TEST(ShapeLimits, AbsorbedMlaIsJudgedByTheLatentKernelsNotTheHeadDims) {
  // Head dims no attention kernel takes (k = 248 + 16 > 256, v = 64): refused decompressed only.
  ModelShapes s = deepseek_fixture();
  s.k_head_dim = 264;
  s.v_head_dim = 64;
  s.rope_offset = 248;
  expect_one(s, {"attention", "head dims k=264, v=64"});
  s.mla_absorbed = true;
  expect_ok(s);
  // DeepSeek-V3 itself in both forms.
  ModelShapes v3 = shapes_of(kSource / "bench" / "configs" / "deepseek-v3-fp8.json");
  EXPECT_EQ(v3.kv_lora_rank, 512);
  expect_ok(v3);
  v3.mla_absorbed = true;
  v3.lora_slots = 8;
  v3.max_lora_rank = kMaxLoraRank;
  expect_ok(v3);
  // Models without MLA ignore the flag.
  ModelShapes q = qwen3_30b();
  q.mla_absorbed = true;
  q.k_head_dim = 264;
  q.v_head_dim = 264;
  q.rope_dim = 64;  // inside the head: only the attention kernels object
  expect_one(q, {"attention", "head dims k=264, v=264"});
}

TEST(ShapeLimits, AbsorbedMlaCacheRowsWiderThanTheLatentKernelsTakeAreRefused) {
  ModelShapes s = deepseek_fixture();
  s.mla_absorbed = true;
  s.kv_lora_rank = kMlaMaxLatent;
  expect_ok(s);
  s.kv_lora_rank = kMlaMaxLatent + 1;
  expect_one(s, {"MLA (absorbed)", "kv_lora_rank 513 + rope 16 = 529", "kv_lora_rank of at most 512",
                 "--mla decompressed"});
  s.kv_lora_rank = kMlaMaxLatent;
  s.rope_dim = kMlaMaxLatentWidth - kMlaMaxLatent;  // the rotary part of the head grows with it
  s.k_head_dim = s.rope_offset + s.rope_dim;
  expect_ok(s);
  s.rope_dim += 2;
  s.k_head_dim += 2;
  expect_one(s, {"MLA (absorbed)", "kv_lora_rank 512 + rope 258 = 770", "at most 768 values"});
  s = deepseek_fixture();
  s.kv_lora_rank = kMlaMaxLatent + 1;  // the decompressed form never reads a latent row
  expect_ok(s);
}

TEST(ShapeLimits, EveryViolationIsNamedInOneMessage) {
  ModelShapes s = qwen3_30b();
  s.k_head_dim = 264;
  s.v_head_dim = 48;
  s.rope_dim = 64;  // still inside the head: only the attention kernels object
  s.moe_intermediate = 776;
  s.max_lora_rank = 256;
  EXPECT_EQ(shape_limit_violations(s).size(), 3u);
  const Status st = check_shape_limits(s);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message().rfind("the CUDA kernels cannot run this qwen3_moe model: attention: head dims k=264, v=48", 0),
            0u)
      << st.message();
  EXPECT_NE(st.message().find("intermediate size 776"), std::string::npos);
  EXPECT_NE(st.message().find("rank up to 256"), std::string::npos);
}

}  // namespace
}  // namespace moelora::cuda_plan
