// PEFT adapter loading: both expert layouts, pattern rules, and a precise error for every
// unsupported or malformed adapter.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "io/safetensors.h"
#include "lora/adapter.h"
#include "lora/adapter_registry.h"
#include "lora/peft_config.h"
#include "model/model_config.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

using testutil::fixture_path;
using testutil::StTensor;
using testutil::TempDir;

ModelConfig qwen_config() {
  auto c = load_model_config(fixture_path("qwen3moe/model-bf16"));
  EXPECT_TRUE(c.ok()) << c.status().message();
  return *c;
}

// A writable copy of a fixture adapter, with optional edits to its config and tensors.
std::string edited_adapter(const TempDir& tmp, const std::string& fixture,
                           const std::function<void(nlohmann::json&)>& edit_config,
                           const std::function<void(std::map<std::string, StTensor>&)>& edit_tensors = nullptr) {
  const std::string dir = tmp.sub("adapter");
  testutil::copy_dir(fixture_path(fixture), dir);
  if (edit_config) {
    auto j = nlohmann::json::parse(testutil::read_file(dir + "/adapter_config.json"));
    edit_config(j);
    testutil::write_file(dir + "/adapter_config.json", j.dump(2));
  }
  if (edit_tensors) {
    auto t = testutil::read_safetensors(dir + "/adapter_model.safetensors");
    edit_tensors(t);
    testutil::write_file(dir + "/adapter_model.safetensors", testutil::make_safetensors(t));
  }
  return dir;
}

std::string load_error(const std::string& dir, const ModelConfig& cfg, AdapterLoadOptions opts = {}) {
  auto a = load_lora_adapter(dir, "x", cfg, opts);
  EXPECT_FALSE(a.ok()) << "the adapter was accepted";
  return a.ok() ? "" : a.status().message();
}

TEST(Adapter, EveryFixtureAdapterLoads) {
  for (const char* arch : {"qwen3moe", "mixtral", "deepseekv3"}) {
    auto cfg = load_model_config(fixture_path(std::string(arch) + "/model-bf16"));
    ASSERT_TRUE(cfg.ok());
    for (const char* name : {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"}) {
      auto a = load_lora_adapter(fixture_path(std::string(arch) + "/adapters/" + name), name, *cfg);
      ASSERT_TRUE(a.ok()) << arch << "/" << name << ": " << a.status().message();
      EXPECT_GT((*a)->bytes, 0u);
    }
  }
}

// A bf16 backend's adapters are converted once at load (AdapterLoadOptions::factor_dtype): every
// factor holds exactly the round-to-nearest-even bf16 of the f32 load's value (what the CUDA
// upload computed before), and the host copy is half the bytes.
TEST(Adapter, Bf16FactorsAreTheRoundedF32FactorsAtHalfTheBytes) {
  const ModelConfig cfg = qwen_config();
  AdapterLoadOptions bf;
  bf.factor_dtype = DType::kBF16;
  auto f32 = load_lora_adapter(fixture_path("qwen3moe/adapters/full-r16"), "f", cfg);
  auto b16 = load_lora_adapter(fixture_path("qwen3moe/adapters/full-r16"), "b", cfg, bf);
  ASSERT_TRUE(f32.ok() && b16.ok());
  EXPECT_TRUE(factors_are(**b16, DType::kBF16));
  EXPECT_FALSE(factors_are(**b16, DType::kF32));
  EXPECT_TRUE(factors_are(**f32, DType::kF32));
  EXPECT_EQ((*b16)->bytes * 2, (*f32)->bytes);
  auto same = [](const Tensor& a, const Tensor& b) {
    if (a.defined() != b.defined()) return false;
    if (!a.defined()) return true;
    if (a.numel() != b.numel() || b.dtype() != DType::kBF16) return false;
    for (int64_t i = 0; i < a.numel(); ++i)
      if (f32_to_bf16(a.ptr<float>()[i]) != b.ptr<uint16_t>()[i]) return false;
    return true;
  };
  int checked = 0;
  for (int l = 0; l < cfg.num_layers; ++l) {
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const LoraFactor &x = (*f32)->dense[l][t], &y = (*b16)->dense[l][t];
      ASSERT_EQ(x.rank, y.rank);
      if (x.rank == 0) continue;
      EXPECT_TRUE(same(x.a, y.a) && same(x.b, y.b)) << "layer " << l << " target " << t;
      ++checked;
    }
    const ExpertLora &x = (*f32)->experts[l], &y = (*b16)->experts[l];
    EXPECT_TRUE(same(x.gu_a, y.gu_a) && same(x.gu_b, y.gu_b) && same(x.d_a, y.d_a) && same(x.d_b, y.d_b))
        << "layer " << l << " experts";
    checked += x.any();
  }
  EXPECT_GT(checked, 0);
  // In-memory conversion does the same; converting again is a no-op.
  LoraAdapter copy = **f32;
  convert_adapter_factors(copy, DType::kBF16);
  EXPECT_EQ(copy.bytes, (*b16)->bytes);
  convert_adapter_factors(copy, DType::kBF16);
  EXPECT_EQ(copy.bytes, (*b16)->bytes);
}

TEST(Adapter, FusedAndPerExpertLayoutsGiveTheSameExpertDeltas) {
  const ModelConfig cfg = qwen_config();
  auto fused = load_lora_adapter(fixture_path("qwen3moe/adapters/full-r16"), "f", cfg);
  auto per = load_lora_adapter(fixture_path("qwen3moe/adapters/full-r16-per-expert"), "p", cfg);
  ASSERT_TRUE(fused.ok() && per.ok());
  // Compare the merged deltas B·A per expert (the factorisations may differ, the math may not).
  const int E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  for (int l = 0; l < cfg.num_layers; ++l) {
    const ExpertLora& f = (*fused)->experts[l];
    const ExpertLora& p = (*per)->experts[l];
    ASSERT_GT(f.gu_rank, 0);
    for (int e = 0; e < E; e += 3) {
      for (int o = 0; o < 2 * I; o += 17) {
        for (int i = 0; i < H; i += 13) {
          auto delta = [&](const ExpertLora& x) {
            double s = 0;
            for (int k = 0; k < x.gu_rank; ++k)
              s += static_cast<double>(x.gu_b.ptr<float>()[(static_cast<int64_t>(e) * 2 * I + o) * x.gu_rank + k]) *
                   x.gu_a.ptr<float>()[(static_cast<int64_t>(e) * x.gu_rank + k) * H + i];
            return s;
          };
          EXPECT_NEAR(delta(f), delta(p), 1e-6) << "layer " << l << " expert " << e << " row " << o;
        }
      }
    }
  }
}

TEST(Adapter, RsLoraScaleIsAlphaOverSqrtRank) {
  PeftConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.use_rslora = true;
  EXPECT_DOUBLE_EQ(c.scale_for("model.layers.0.self_attn.o_proj"), 4.0);
  c.use_rslora = false;
  EXPECT_DOUBLE_EQ(c.scale_for("model.layers.0.self_attn.o_proj"), 2.0);
}

TEST(PeftPattern, MatchesPeftRule) {
  EXPECT_TRUE(peft_pattern_matches("q_proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft_pattern_matches("q_proj", "model.layers.0.self_attn.kq_proj"));
  EXPECT_FALSE(peft_pattern_matches("q_proj", "model.layers.0.self_attn.q_proj.extra"));
  EXPECT_TRUE(peft_pattern_matches(".*\\.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(peft_pattern_matches("layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft_pattern_matches("layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj"));
}

TEST(PeftPattern, FirstKeyInFileOrderWins) {
  auto c = parse_peft_config(R"({"r":8,"lora_alpha":8,"rank_pattern":{"proj":2,"q_proj":4},
                                 "alpha_pattern":{"q_proj":3,"proj":5}})", "cfg");
  ASSERT_TRUE(c.ok()) << c.status().message();
  // ".*proj" is not how PEFT reads "proj": the key must match a whole dotted suffix.
  EXPECT_EQ(c->rank_for("model.layers.0.self_attn.q_proj"), 4);
  EXPECT_EQ(c->rank_for("model.layers.0.mlp.proj"), 2);
  EXPECT_EQ(c->alpha_for("model.layers.0.self_attn.q_proj"), 3);
  EXPECT_EQ(c->alpha_for("model.layers.0.self_attn.o_proj"), 8);
}

TEST(PeftConfigErrors, InvalidRegexAndTypes) {
  auto c = parse_peft_config(R"({"r":8,"lora_alpha":8,"rank_pattern":{"(unclosed":2}})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("not a valid regex"), std::string::npos);
  c = parse_peft_config(R"({"r":"8","lora_alpha":8})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("\"r\" must be a positive integer"), std::string::npos);
  c = parse_peft_config(R"({"r":8,"lora_alpha":8,"peft_type":"IA3"})", "cfg");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("is not LORA"), std::string::npos);
}

struct ConfigCase {
  const char* field;
  nlohmann::json value;
  const char* message;
};

TEST(AdapterErrors, UnsupportedConfigFieldsAreNamed) {
  const ModelConfig cfg = qwen_config();
  const std::vector<ConfigCase> cases = {
      {"use_dora", true, "DoRA"},
      {"bias", "all", "\"bias\""},
      {"lora_bias", true, "lora_bias"},
      {"fan_in_fan_out", true, "fan_in_fan_out"},
      {"modules_to_save", nlohmann::json::array({"lm_head"}), "modules_to_save"},
      {"layer_replication", nlohmann::json::array({nlohmann::json::array({0, 1})}), "layer_replication"},
  };
  for (const ConfigCase& c : cases) {
    TempDir tmp;
    const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", [&](nlohmann::json& j) { j[c.field] = c.value; });
    const std::string err = load_error(dir, cfg);
    EXPECT_NE(err.find(c.message), std::string::npos) << c.field << ": " << err;
  }
}

TEST(AdapterErrors, UnknownTargetModule) {
  TempDir tmp;
  const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr, [](auto& t) {
    t["base_model.model.model.layers.0.mlp.foo_proj.lora_A.weight"] = testutil::f32_tensor({8, 128}, testutil::random_values(8 * 128, 1));
    t["base_model.model.model.layers.0.mlp.foo_proj.lora_B.weight"] = testutil::f32_tensor({128, 8}, testutil::random_values(8 * 128, 2));
  });
  const std::string err = load_error(dir, qwen_config());
  EXPECT_NE(err.find("model.layers.0.mlp.foo_proj"), std::string::npos) << err;
}

TEST(AdapterErrors, LayerOutOfRangeAndRouterLora) {
  TempDir tmp;
  std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr, [](auto& t) {
    t["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = testutil::f32_tensor({8, 128}, testutil::random_values(8 * 128, 1));
    t["base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight"] = testutil::f32_tensor({128, 8}, testutil::random_values(8 * 128, 2));
  });
  EXPECT_NE(load_error(dir, qwen_config()).find("layer 9 does not exist"), std::string::npos);
  TempDir tmp2;
  dir = edited_adapter(tmp2, "qwen3moe/adapters/attn-r8", nullptr, [](auto& t) {
    t["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = testutil::f32_tensor({8, 128}, testutil::random_values(8 * 128, 1));
    t["base_model.model.model.layers.0.mlp.gate.lora_B.weight"] = testutil::f32_tensor({8, 8}, testutil::random_values(64, 2));
  });
  EXPECT_NE(load_error(dir, qwen_config()).find("router is not supported"), std::string::npos);
}

TEST(AdapterErrors, RankMismatchBetweenConfigAndTensors) {
  TempDir tmp;
  const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", [](nlohmann::json& j) { j["r"] = 4; });
  const std::string err = load_error(dir, qwen_config());
  EXPECT_NE(err.find("gives rank 4 but the tensors have rank 8"), std::string::npos) << err;
}

TEST(AdapterErrors, NanWeights) {
  TempDir tmp;
  const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/mlp-rslora-r4", nullptr, [](auto& t) {
    auto& b = t.at("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight");
    const float nan = std::nanf("");
    std::memcpy(b.bytes.data() + 40, &nan, 4);
  });
  const std::string err = load_error(dir, qwen_config());
  EXPECT_NE(err.find("contains NaN or inf"), std::string::npos) << err;
  EXPECT_NE(err.find("o_proj.lora_B"), std::string::npos) << err;
}

TEST(AdapterErrors, WrongDtypeAndShape) {
  TempDir tmp;
  std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr, [](auto& t) {
    auto& a = t.at("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
    a.dtype = "I16";  // same byte size as bf16, wrong type
  });
  EXPECT_NE(load_error(dir, qwen_config()).find("dtype I16; LoRA weights must be F32, BF16 or F16"), std::string::npos);
  TempDir tmp2;
  dir = edited_adapter(tmp2, "qwen3moe/adapters/attn-r8", nullptr, [](auto& t) {
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] =
        testutil::bf16_tensor({8, 64}, testutil::random_values(8 * 64, 3));
  });
  EXPECT_NE(load_error(dir, qwen_config()).find("do not fit the base"), std::string::npos);
}

TEST(AdapterErrors, HalfAPairAndRankAboveMaximum) {
  TempDir tmp;
  std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr,
                                   [](auto& t) { t.erase("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"); });
  EXPECT_NE(load_error(dir, qwen_config()).find("has lora_A but no lora_B"), std::string::npos);
  TempDir tmp2;
  dir = edited_adapter(tmp2, "qwen3moe/adapters/attn-r8", nullptr);
  AdapterLoadOptions opts;
  opts.max_rank = 4;
  EXPECT_NE(load_error(dir, qwen_config(), opts).find("above the configured maximum 4"), std::string::npos);
}

TEST(AdapterErrors, DoraEmbeddingAndFullWeightTensors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"},
      {"base_model.model.model.embed_tokens.lora_embedding_A", "embedding LoRA"},
      {"base_model.model.lm_head.weight", "modules_to_save"},
      {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "lora_bias"},
  };
  for (const auto& [key, msg] : cases) {
    TempDir tmp;
    const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr,
                                           [&](auto& t) { t[key] = testutil::f32_tensor({4}, {1, 2, 3, 4}); });
    const std::string err = load_error(dir, qwen_config());
    EXPECT_NE(err.find(msg), std::string::npos) << key << ": " << err;
  }
}

TEST(AdapterErrors, FilesMissingOrPickled) {
  const ModelConfig cfg = qwen_config();
  auto a = load_lora_adapter("/nonexistent/adapter", "x", cfg);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), ErrorCode::kNotFound);
  TempDir tmp;
  testutil::write_file(tmp.sub("adapter_config.json"), R"({"r":8,"lora_alpha":8})");
  testutil::write_file(tmp.sub("adapter_model.bin"), "pickle");
  EXPECT_NE(load_error(tmp.str(), cfg).find("pickle files are code"), std::string::npos);
}

TEST(AdapterErrors, AddedTokens) {
  TempDir tmp;
  const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", nullptr);
  testutil::write_file(dir + "/added_tokens.json", R"({"<new>": 300})");
  EXPECT_NE(load_error(dir, qwen_config()).find("adds token '<new>'"), std::string::npos);
  testutil::write_file(dir + "/added_tokens.json", R"({"<old>": 3})");  // copied from the base: fine
  EXPECT_TRUE(load_lora_adapter(dir, "x", qwen_config()).ok());
}

// A synthetic fused-expert adapter with 2*I == H, the case where lora_B shapes alone cannot tell
// gate_up_proj from down_proj: lora_A's input width (H vs I) still does, whatever the order of
// target_parameters; and the expert-major A / expert-minor B layout is honoured.
TEST(AdapterFused, TwoIEqualsHIsResolvedByShapesInEitherParameterOrder) {
  auto cfg = parse_model_config(R"({"model_type":"qwen3_moe","vocab_size":16,"hidden_size":8,"num_hidden_layers":1,
      "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"num_experts":2,"num_experts_per_tok":1,
      "moe_intermediate_size":4,"intermediate_size":16})", "synthetic");
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  const int E = 2, H = 8, I = 4, r = 2;
  TempDir tmp;
  // gate_up: A [r*E, H], B [2I, r*E]; down: A [r*E, I], B [H, r*E]. 2I == H == 8.
  std::vector<float> gu_a = testutil::random_values(r * E * H, 11), gu_b = testutil::random_values(2 * I * r * E, 12);
  std::vector<float> d_a = testutil::random_values(r * E * I, 13), d_b = testutil::random_values(H * r * E, 14);
  testutil::write_file(tmp.sub("adapter_model.safetensors"), testutil::make_safetensors({
      {"base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight", testutil::f32_tensor({r * E, H}, gu_a)},
      {"base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight", testutil::f32_tensor({2 * I, r * E}, gu_b)},
      {"base_model.model.model.layers.0.mlp.experts.lora_A.weight", testutil::f32_tensor({r * E, I}, d_a)},
      {"base_model.model.model.layers.0.mlp.experts.lora_B.weight", testutil::f32_tensor({H, r * E}, d_b)},
  }));
  for (const char* order : {R"(["gate_up_proj","down_proj"])", R"(["down_proj","gate_up_proj"])"}) {
  testutil::write_file(tmp.sub("adapter_config.json"),
                       std::string(R"({"r":2,"lora_alpha":4,"target_parameters":)") + order + "}");
  auto a = load_lora_adapter(tmp.str(), "syn", *cfg);
  ASSERT_TRUE(a.ok()) << a.status().message();
  const ExpertLora& x = (*a)->experts[0];
  ASSERT_EQ(x.gu_rank, r);
  ASSERT_EQ(x.d_rank, r);
  ASSERT_EQ(x.gu_b.dim(1), 2 * I);
  // Expert 1, gate_up row 3, rank column 1: B[3][1*E + 1] * (alpha / r = 2).
  EXPECT_FLOAT_EQ(x.gu_b.ptr<float>()[(1 * 2 * I + 3) * r + 1], gu_b[3 * r * E + 1 * E + 1] * 2.0f);
  // Expert 1, A rows are expert-major: row 1*r + 0.
  EXPECT_FLOAT_EQ(x.gu_a.ptr<float>()[(1 * r + 0) * H + 5], gu_a[(1 * r + 0) * H + 5]);
  EXPECT_FLOAT_EQ(x.d_b.ptr<float>()[(0 * H + 7) * r + 1], d_b[7 * r * E + 1 * E + 0] * 2.0f);
  }
}

TEST(AdapterFused, ShapesThatFitNeitherParameterAreRefused) {
  TempDir tmp;
  const std::string dir = edited_adapter(tmp, "qwen3moe/adapters/full-r16", nullptr, [](auto& t) {
    t["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] =
        testutil::bf16_tensor({100, 128}, testutil::random_values(100 * 128, 5));
  });
  const std::string err = load_error(dir, qwen_config());
  EXPECT_NE(err.find("fits neither gate_up_proj"), std::string::npos) << err;
}

TEST(AdapterRegistry, AFailedLoadChangesNothing) {
  const ModelConfig cfg = qwen_config();
  AdapterRegistry reg(cfg, {}, 4, "");
  ASSERT_TRUE(reg.load("good", fixture_path("qwen3moe/adapters/attn-r8"), false).ok());
  TempDir tmp;
  const std::string bad = edited_adapter(tmp, "qwen3moe/adapters/attn-r8", [](nlohmann::json& j) { j["use_dora"] = true; });
  EXPECT_FALSE(reg.load("bad", bad, false).ok());
  EXPECT_EQ(reg.load("good", fixture_path("qwen3moe/adapters/pattern"), false).code(), ErrorCode::kAlreadyExists);
  auto list = reg.list();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].name, "good");
  EXPECT_NE(list[0].path.find("attn-r8"), std::string::npos);
}

TEST(AdapterRegistry, PathsAreConfinedToTheRoot) {
  const ModelConfig cfg = qwen_config();
  AdapterRegistry reg(cfg, {}, 4, fixture_path("qwen3moe/adapters"));
  EXPECT_TRUE(reg.load("a", "attn-r8", false).ok());
  Status s = reg.load("b", fixture_path("qwen3moe/adapters/../model-bf16"), false);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("outside --lora-root"), std::string::npos);
  EXPECT_FALSE(reg.load("c", "../../mixtral/adapters/attn-r8", false).ok());
}

TEST(AdapterRegistry, HostCapEvictsLeastRecentlyUsedAndReloads) {
  const ModelConfig cfg = qwen_config();
  AdapterRegistry reg(cfg, {}, 2, "");
  ASSERT_TRUE(reg.load("a", fixture_path("qwen3moe/adapters/attn-r8"), true).ok());  // pinned
  ASSERT_TRUE(reg.load("b", fixture_path("qwen3moe/adapters/pattern"), false).ok());
  ASSERT_TRUE(reg.load("c", fixture_path("qwen3moe/adapters/mlp-rslora-r4"), false).ok());
  int on_host = 0;
  for (const auto& i : reg.list()) on_host += i.on_host;
  EXPECT_EQ(on_host, 2);
  for (const auto& i : reg.list())
    if (i.name == "a") EXPECT_TRUE(i.on_host);  // pinned stays
  auto b = reg.get("b");  // dropped from host memory: read again transparently
  ASSERT_TRUE(b.ok());
  EXPECT_GT((*b)->bytes, 0u);
}

}  // namespace
}  // namespace moelora
