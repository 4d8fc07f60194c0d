// config.json parsing (hub and transformers-5 spellings), rotary tables, and weight loading errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "backends/cpu/cpu_backend.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/weight_loader.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

TEST(ModelConfig, HubAndTransformers5SpellingsAgree) {
  const std::string hub = R"({"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"num_hidden_layers":2,
    "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"num_experts":4,"num_experts_per_tok":2,
    "moe_intermediate_size":4,"intermediate_size":8,"rope_theta":5000.0,"torch_dtype":"bfloat16",
    "norm_topk_prob":true,"mlp_only_layers":[1]})";
  const std::string t5 = R"({"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"num_hidden_layers":2,
    "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"num_local_experts":4,"num_experts_per_tok":2,
    "moe_intermediate_size":4,"intermediate_size":8,"rope_parameters":{"rope_theta":5000.0,"rope_type":"default"},
    "dtype":"bfloat16","norm_topk_prob":true,"mlp_only_layers":[1]})";
  auto a = parse_model_config(hub, "hub");
  auto b = parse_model_config(t5, "t5");
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(a->num_experts, 4);
  EXPECT_EQ(b->num_experts, 4);
  EXPECT_EQ(a->rope.theta, 5000.0);
  EXPECT_EQ(b->rope.theta, 5000.0);
  EXPECT_EQ(a->layer_is_moe, (std::vector<bool>{true, false}));
  EXPECT_EQ(b->layer_is_moe, (std::vector<bool>{true, false}));
}

// The benchmark configs (bench/configs) are what `moelora bench` and the H200 records use: each one
// parses, and each declares the weight format its file name says.
TEST(ModelConfig, EveryBenchConfigParsesWithItsWeightFormat) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(MOELORA_SOURCE_DIR) + "/bench/configs")) {
    if (e.path().extension() != ".json") continue;
    std::ifstream f(e.path());
    std::stringstream text;
    text << f.rdbuf();
    const std::string name = e.path().filename().string();
    auto cfg = parse_model_config(text.str(), name);
    ASSERT_TRUE(cfg.ok()) << name << ": " << cfg.status().message();
    if (name.find("nvfp4") != std::string::npos)
      EXPECT_TRUE(cfg->weight_format.is_nvfp4()) << name;
    else if (name.find("fp8") != std::string::npos)
      EXPECT_TRUE(cfg->weight_format.is_fp8()) << name;
    ++n;
  }
  EXPECT_GE(n, 5);
}

TEST(ModelConfig, UnknownModelTypeNamesTheSupportedOnes) {
  auto c = parse_model_config(R"({"model_type":"llama","vocab_size":10})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("qwen3_moe, mixtral and deepseek_v3"), std::string::npos);
}

TEST(ModelConfig, MissingAndWrongFields) {
  auto c = parse_model_config(R"({"model_type":"mixtral","vocab_size":10,"hidden_size":8})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("num_hidden_layers"), std::string::npos);
  c = parse_model_config(R"({"model_type":"mixtral","vocab_size":"10"})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("\"vocab_size\" must be an integer"), std::string::npos);
  c = parse_model_config("{not json", "cfg");
  ASSERT_FALSE(c.ok());
}

TEST(ModelConfig, DeepSeekYarnAsRealCheckpointsWriteIt) {
  const std::string cfg = R"({"model_type":"deepseek_v3","vocab_size":16,"hidden_size":64,"num_hidden_layers":4,
    "num_attention_heads":2,"num_key_value_heads":2,"n_routed_experts":8,"num_experts_per_tok":2,"n_group":4,
    "topk_group":2,"moe_intermediate_size":16,"intermediate_size":32,"first_k_dense_replace":1,
    "n_shared_experts":1,"routed_scaling_factor":2.5,"q_lora_rank":16,"kv_lora_rank":16,"qk_nope_head_dim":8,
    "qk_rope_head_dim":8,"v_head_dim":8,"rope_theta":10000,"max_position_embeddings":163840,
    "num_nextn_predict_layers":1,
    "rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,"mscale_all_dim":1.0,
                    "original_max_position_embeddings":4096,"type":"yarn"},
    "quantization_config":{"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,128]}})";
  auto c = parse_model_config(cfg, "ds");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->weight_format, WeightFormat::fp8_block(128, 128));
  EXPECT_TRUE(c->rope.interleaved);
  EXPECT_EQ(c->layer_is_moe, (std::vector<bool>{false, true, true, true}));
  // softmax scale = (qk_head_dim)^-0.5 * mscale(40, 1)^2 with mscale = 0.1 ln 40 + 1.
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c->attention_scale(), m * m / std::sqrt(16.0), 1e-12);
  RopeTable t = make_rope_table(*c);
  ASSERT_EQ(t.inv_freq.size(), 4u);
  EXPECT_FLOAT_EQ(t.attention_factor, 1.0f);  // mscale / mscale_all_dim
  // YaRN: the highest frequency is kept (extrapolated), the lowest is divided by the factor.
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);
  const float lowest = 1.0f / std::pow(10000.0f, 6.0f / 8.0f);
  EXPECT_NEAR(t.inv_freq[3], lowest / 40.0f, 1e-9);
}

TEST(WeightLoading, WrongShapeMissingTensorAndUnscaledFp8) {
  CpuBackend backend;
  const std::string src = testutil::fixture_path("mixtral/model-fp8");
  auto cfg = load_model_config(src);
  ASSERT_TRUE(cfg.ok());
  auto rewrite = [&](const std::function<void(std::map<std::string, testutil::StTensor>&)>& edit) {
    return testutil::edited_checkpoint(src, edit);
  };
  auto load_err = [&](const testutil::TempDir& d) {
    auto ck = Checkpoint::open(d.str());
    EXPECT_TRUE(ck.ok());
    auto w = load_model_weights(*ck, *cfg, backend);
    EXPECT_FALSE(w.ok());
    return w.ok() ? std::string() : w.status().message();
  };
  auto d1 = rewrite([](auto& t) {
    t["model.layers.0.self_attn.o_proj.weight"].shape = {64, 256};
  });
  EXPECT_NE(load_err(*d1).find("'model.layers.0.self_attn.o_proj.weight' has shape [64, 256] but the config implies [128, 128]"),
            std::string::npos);
  auto d2 = rewrite([](auto& t) { t.erase("model.layers.1.block_sparse_moe.experts.3.w2.weight"); });
  EXPECT_NE(load_err(*d2).find("experts.3.w2.weight"), std::string::npos);
  auto d3 = rewrite([](auto& t) { t.erase("model.layers.0.self_attn.q_proj.weight_scale_inv"); });
  EXPECT_NE(load_err(*d3).find("has no 'model.layers.0.self_attn.q_proj.weight_scale_inv'"), std::string::npos);
}

}  // namespace
}  // namespace moelora
