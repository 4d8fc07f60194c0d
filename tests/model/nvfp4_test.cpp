// NVFP4 checkpoints as ModelOpt exports them: the quantisation config in its three forms, the
// loader's checks of every new tensor, and the fixtures' models loading as exactly their
// dequantised weights (the dequantisation itself is checked against float64 in cpu_ops_test).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/weight_loader.h"
#include "ops/weight_format.h"
#include "tests/testutil/forwarding_backend.h"
#include "tests/testutil/scripted_steps.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

using testutil::StTensor;

const char* kQwenConfig = R"({"model_type":"qwen3_moe","vocab_size":32,"hidden_size":64,"num_hidden_layers":1,
  "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32,"num_experts":4,"num_experts_per_tok":2,
  "moe_intermediate_size":32)";

std::string config_with(const std::string& quant) { return std::string(kQwenConfig) + ",\"quantization_config\":" + quant + "}"; }

TEST(Nvfp4Config, ModelOptQuantizationConfigInConfigJson) {
  // The newer export: quant_method "modelopt", group size inside config_groups, "ignore".
  auto c = parse_model_config(config_with(R"({"quant_method":"modelopt","quant_algo":"NVFP4",
      "config_groups":{"group_0":{"targets":["Linear"],"weights":{"num_bits":4,"type":"float","group_size":16}}},
      "ignore":["lm_head","model.layers.*.mlp.gate","model.layers.*.self_attn*"]})"),
                              "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->weight_format, WeightFormat::nvfp4(16));
  EXPECT_TRUE(c->quant_excluded("lm_head"));
  EXPECT_TRUE(c->quant_excluded("model.layers.7.mlp.gate"));
  EXPECT_FALSE(c->quant_excluded("model.layers.7.mlp.gate_proj"));  // a glob, not a prefix of the name
  EXPECT_TRUE(c->quant_excluded("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(c->quant_excluded("model.layers.0.mlp.experts.3.down_proj"));
}

TEST(Nvfp4Config, ParentModulesAndExactNamesExclude) {
  ModelConfig c;
  c.quant_exclude = {"model.layers.1.self_attn", "model.layers.2.mlp.experts.?.up_proj"};
  EXPECT_TRUE(c.quant_excluded("model.layers.1.self_attn.o_proj"));
  EXPECT_FALSE(c.quant_excluded("model.layers.11.self_attn.o_proj"));
  EXPECT_TRUE(c.quant_excluded("model.layers.2.mlp.experts.5.up_proj"));
  EXPECT_FALSE(c.quant_excluded("model.layers.2.mlp.experts.15.up_proj"));
}

TEST(Nvfp4Config, WhatIsNotNvfp4IsRefusedByName) {
  auto fp8 = parse_model_config(config_with(R"({"quant_method":"modelopt","quant_algo":"FP8"})"), "config.json");
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.status().message().find("quant_algo \"FP8\" is not supported"), std::string::npos);
  auto g32 = parse_model_config(config_with(R"({"quant_method":"modelopt","quant_algo":"NVFP4","group_size":32})"),
                                "config.json");
  ASSERT_FALSE(g32.ok());
  EXPECT_NE(g32.status().message().find("group_size 32"), std::string::npos);
  auto no_algo = parse_model_config(config_with(R"({"quant_method":"modelopt"})"), "config.json");
  ASSERT_FALSE(no_algo.ok());
  EXPECT_NE(no_algo.status().message().find("quant_algo"), std::string::npos);
  auto bad_ignore =
      parse_model_config(config_with(R"({"quant_method":"modelopt","quant_algo":"NVFP4","ignore":"lm_head"})"),
                         "config.json");
  ASSERT_FALSE(bad_ignore.ok());
  EXPECT_NE(bad_ignore.status().message().find("\"ignore\" must be a list"), std::string::npos);
  auto awq = parse_model_config(config_with(R"({"quant_method":"awq"})"), "config.json");
  ASSERT_FALSE(awq.ok());
  EXPECT_NE(awq.status().message().find("quant_method \"awq\" is not supported"), std::string::npos);
}

TEST(Nvfp4Config, HfQuantConfigJsonAloneOrAgreeingWithConfigJson) {
  // The mixtral fixture declares NVFP4 only in hf_quant_config.json (the older ModelOpt export).
  auto only = load_model_config(testutil::fixture_path("mixtral/model-nvfp4"));
  ASSERT_TRUE(only.ok()) << only.status().message();
  EXPECT_EQ(only->weight_format, WeightFormat::nvfp4(16));
  EXPECT_TRUE(only->quant_excluded("model.layers.1.self_attn.k_proj"));
  // qwen3moe declares it in both files.
  auto both = load_model_config(testutil::fixture_path("qwen3moe/model-nvfp4"));
  ASSERT_TRUE(both.ok()) << both.status().message();
  EXPECT_EQ(both->weight_format, WeightFormat::nvfp4(16));

  testutil::TempDir d;
  testutil::write_file(d.sub("config.json"), config_with(R"({"quant_method":"fp8","weight_block_size":[128,128]})"));
  testutil::write_file(d.sub("hf_quant_config.json"),
                       R"({"quantization":{"quant_algo":"NVFP4","group_size":16,"exclude_modules":["lm_head"]}})");
  auto disagree = load_model_config(d.str());
  ASSERT_FALSE(disagree.ok());
  EXPECT_NE(disagree.status().message().find("declares NVFP4"), std::string::npos) << disagree.status().message();
  testutil::write_file(d.sub("hf_quant_config.json"), R"({"producer":{"name":"modelopt"}})");
  auto malformed = load_model_config(d.str());
  ASSERT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find("\"quantization\" object"), std::string::npos);
}

// The NVFP4 checkpoint with every packed weight replaced by its f32 dequantisation and the
// quantisation config removed: what the engine must compute, written as a plain checkpoint.
std::unique_ptr<testutil::TempDir> dequantised_copy(const std::string& src) {
  auto dir = testutil::edited_checkpoint(src, [](std::map<std::string, StTensor>& t) {
    std::map<std::string, StTensor> out;
    for (auto& [name, st] : t) {
      const bool scale = name.ends_with(".weight_scale") || name.ends_with(".weight_scale_2") ||
                         name.ends_with(".input_scale");
      if (scale) continue;
      if (st.dtype != "U8") {
        out[name] = st;
        continue;
      }
      const std::string m = name.substr(0, name.size() - std::string(".weight").size());
      const StTensor& s = t.at(m + ".weight_scale");
      float global = 0.0f;
      std::memcpy(&global, t.at(m + ".weight_scale_2").bytes.data(), 4);
      const int rows = static_cast<int>(st.shape[0]), cols = static_cast<int>(st.shape[1]) * 2;
      std::vector<float> w(static_cast<size_t>(rows) * cols);
      dequantize_nvfp4(st.bytes.data(), rows, cols, s.bytes.data(), global, w.data());
      out[name] = testutil::f32_tensor({rows, cols}, w);
    }
    t = std::move(out);
  });
  std::string cfg = testutil::read_file(dir->sub("config.json"));
  auto j = nlohmann::json::parse(cfg);
  j.erase("quantization_config");
  testutil::write_file(dir->sub("config.json"), j.dump());
  std::filesystem::remove(dir->sub("hf_quant_config.json"));
  return dir;
}

class Nvfp4Checkpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(Nvfp4Checkpoint, ComputesExactlyWhatItsDequantisedWeightsCompute) {
  const std::string src = testutil::fixture_path(GetParam() + "/model-nvfp4");
  auto dense_dir = dequantised_copy(src);
  CpuBackend backend;
  auto packed = Model::load(src, backend);
  ASSERT_TRUE(packed.ok()) << packed.status().message();
  auto dense = Model::load(dense_dir->str(), backend);
  ASSERT_TRUE(dense.ok()) << dense.status().message();
  EXPECT_TRUE((*packed)->config().weight_format.is_nvfp4());
  EXPECT_TRUE((*dense)->config().weight_format.is_dense());

  const int V = (*packed)->config().vocab_size;
  auto steps = testutil::scripted_steps({{{3, 17, 42, 5, 9}}, {{100, 7}}}, 4, 3, 0,
                                        [&](int d, int s) { return static_cast<int32_t>((d * 31 + s * 7 + 11) % V); });
  auto kv_p = (*packed)->alloc_kv_cache(steps.num_pages, 4);
  auto kv_d = (*dense)->alloc_kv_cache(steps.num_pages, 4);
  for (const StepBatch& b : steps.steps) {
    Tensor lp = (*packed)->forward(b, kv_p, nullptr);
    Tensor ld = (*dense)->forward(b, kv_d, nullptr);
    ASSERT_EQ(lp.shape(), ld.shape());
    for (int64_t i = 0; i < lp.numel(); ++i) ASSERT_EQ(lp.ptr<float>()[i], ld.ptr<float>()[i]) << GetParam() << " " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Nvfp4Checkpoint, ::testing::Values("qwen3moe", "mixtral", "deepseekv3"));

// llm-compressor's layout of the same numbers: weight_packed, and weight_global_scale holding the
// reciprocal of ModelOpt's weight_scale_2.
std::unique_ptr<testutil::TempDir> compressed_tensors_copy(const std::string& src) {
  auto dir = testutil::edited_checkpoint(src, [](std::map<std::string, StTensor>& t) {
    std::map<std::string, StTensor> out;
    for (auto& [name, st] : t) {
      if (st.dtype == "U8") {
        out[name.substr(0, name.size() - 7) + ".weight_packed"] = st;
      } else if (name.ends_with(".weight_scale_2")) {
        float g = 0.0f;
        std::memcpy(&g, st.bytes.data(), 4);
        out[name.substr(0, name.size() - 15) + ".weight_global_scale"] = testutil::f32_tensor({1}, {1.0f / g});
      } else if (name.ends_with(".input_scale")) {
        out[name.substr(0, name.size() - 12) + ".input_global_scale"] = st;
      } else {
        out[name] = st;
      }
    }
    t = std::move(out);
  });
  auto j = nlohmann::json::parse(testutil::read_file(dir->sub("config.json")));
  j["quantization_config"] = nlohmann::json::parse(R"({"quant_method":"compressed-tensors",
      "format":"nvfp4-pack-quantized","quantization_status":"compressed","ignore":["lm_head","re:.*mlp\\.gate$"],
      "config_groups":{"group_0":{"targets":["Linear"],"weights":{"num_bits":4,"type":"float",
      "strategy":"tensor_group","group_size":16,"symmetric":true,"dynamic":false},
      "input_activations":{"num_bits":4,"type":"float","strategy":"tensor_group","group_size":16,"dynamic":"local"}}}})");
  testutil::write_file(dir->sub("config.json"), j.dump());
  std::filesystem::remove(dir->sub("hf_quant_config.json"));
  return dir;
}

TEST(Nvfp4Layouts, CompressedTensorsLoadsTheSameModel) {
  const std::string src = testutil::fixture_path("qwen3moe/model-nvfp4");
  auto ct_dir = compressed_tensors_copy(src);
  CpuBackend backend;
  auto modelopt = Model::load(src, backend);
  ASSERT_TRUE(modelopt.ok()) << modelopt.status().message();
  auto ct = Model::load(ct_dir->str(), backend);
  ASSERT_TRUE(ct.ok()) << ct.status().message();
  EXPECT_EQ((*ct)->config().weight_format, WeightFormat::nvfp4(16));
  auto steps = testutil::scripted_steps({{{3, 17, 42, 5, 9}}}, 4, 2, 0, [](int d, int) { return 20 + d; });
  auto kv_m = (*modelopt)->alloc_kv_cache(steps.num_pages, 4);
  auto kv_c = (*ct)->alloc_kv_cache(steps.num_pages, 4);
  for (const StepBatch& b : steps.steps) {
    Tensor lm = (*modelopt)->forward(b, kv_m, nullptr);
    Tensor lc = (*ct)->forward(b, kv_c, nullptr);
    // The global scale goes through a reciprocal and back: the weights agree to an f32 ulp or two.
    float scale = 0.0f, diff = 0.0f;
    for (int64_t i = 0; i < lm.numel(); ++i) {
      scale = std::max(scale, std::fabs(lm.ptr<float>()[i]));
      diff = std::max(diff, std::fabs(lm.ptr<float>()[i] - lc.ptr<float>()[i]));
    }
    EXPECT_LE(diff, 1e-5f * scale) << diff << " of " << scale;
  }
}

TEST(Nvfp4Config, CompressedTensorsSchemesOtherThanNvfp4AreRefused) {
  auto int4 = parse_model_config(config_with(R"({"quant_method":"compressed-tensors","format":"pack-quantized",
      "config_groups":{"g":{"weights":{"num_bits":4,"type":"int","group_size":128}}}})"), "config.json");
  ASSERT_FALSE(int4.ok());
  EXPECT_NE(int4.status().message().find("format \"pack-quantized\" is not supported"), std::string::npos)
      << int4.status().message();
  auto fp4_32 = parse_model_config(config_with(R"({"quant_method":"compressed-tensors",
      "config_groups":{"g":{"format":"nvfp4-pack-quantized","weights":{"num_bits":4,"type":"float","group_size":32}}}})"),
                                   "config.json");
  ASSERT_FALSE(fp4_32.ok());
  EXPECT_NE(fp4_32.status().message().find("group size 32 are not NVFP4"), std::string::npos);
  auto no_groups = parse_model_config(config_with(R"({"quant_method":"compressed-tensors"})"), "config.json");
  ASSERT_FALSE(no_groups.ok());
  EXPECT_NE(no_groups.status().message().find("needs \"config_groups\""), std::string::npos);
}

TEST(Nvfp4Loading, BadTensorsAreClearErrors) {
  const std::string src = testutil::fixture_path("qwen3moe/model-nvfp4");
  auto cfg = load_model_config(src);
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  CpuBackend backend;
  auto error_of = [&](const std::function<void(std::map<std::string, StTensor>&)>& edit,
                      const ModelConfig* config = nullptr) {
    auto d = testutil::edited_checkpoint(src, edit);
    auto ck = Checkpoint::open(d->str());
    if (!ck.ok()) return "(checkpoint did not open) " + ck.status().message();
    auto w = load_model_weights(*ck, config ? *config : *cfg, backend);
    return w.ok() ? std::string("(loaded)") : w.status().message();
  };
  const std::string q = "model.layers.0.self_attn.q_proj";
  const std::string e = "model.layers.1.mlp.experts.2.down_proj";
  auto expect_error = [&](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  expect_error(error_of([&](auto& t) { t.erase(q + ".weight_scale"); }), "has no '" + q + ".weight_scale'");
  expect_error(error_of([&](auto& t) { t.erase(e + ".weight_scale_2"); }), "has no '" + e + ".weight_scale_2'");
  expect_error(error_of([&](auto& t) { t[q + ".weight_scale"].shape = {64, 16}; }),
               "block scales have shape [64, 16] but NVFP4 (e2m1, 16-value groups) implies [128, 8]");
  expect_error(error_of([&](auto& t) {
                 StTensor& s = t[q + ".weight_scale"];
                 s.dtype = "U8";
               }),
               "NVFP4 block scales must be F8_E4M3, not U8");
  expect_error(error_of([&](auto& t) { t[e + ".weight_scale"].bytes[5] = 0x7f; }), "block scale 5 is NaN");
  expect_error(error_of([&](auto& t) { t[e + ".weight_scale"].bytes[0] = 0xb8; }), "block scale 0 is negative");
  expect_error(error_of([&](auto& t) { t[e + ".weight_scale_2"] = testutil::f32_tensor({2}, {1.0f, 1.0f}); }),
               "must be one F32 value");
  expect_error(error_of([&](auto& t) { t[e + ".weight_scale_2"] = testutil::f32_tensor({}, {0.0f}); }),
               "global scale (weight_scale_2) is 0");
  expect_error(error_of([&](auto& t) { t[q + ".weight"].shape = {256, 32}; }),
               "weight has shape [256, 32] but NVFP4 (e2m1, 16-value groups) implies [128, 64]");
  // A dense expert among packed ones: the expert kernels take one format per layer.
  expect_error(error_of([&](auto& t) {
                 t[e + ".weight"] = testutil::bf16_tensor({128, 192}, testutil::random_values(128 * 192, 3));
                 for (const char* s : {".weight_scale", ".weight_scale_2", ".input_scale"}) t.erase(e + s);
               }),
               "mixes weight formats in its experts");
  // Scales next to a dense weight are a damaged export, not something to ignore.
  expect_error(error_of([&](auto& t) {
                 t["lm_head.weight_scale"] = t[q + ".weight_scale"];
               }),
               "'lm_head.weight_scale' exists but");
  // Packed weights under a config that does not declare NVFP4, or that excludes the module.
  ModelConfig undeclared = *cfg;
  undeclared.weight_format = WeightFormat::dense();
  expect_error(error_of([](auto&) {}, &undeclared), "is U8 (packed 4-bit) but the config declares no NVFP4");
  ModelConfig excluding = *cfg;
  excluding.quant_exclude.push_back("model.layers.0.self_attn");
  expect_error(error_of([](auto&) {}, &excluding), "the quantisation config excludes 'model.layers.0.self_attn.");
  // And the untouched checkpoint loads.
  EXPECT_EQ(error_of([](auto&) {}), "(loaded)");
}

TEST(Nvfp4Loading, CompressedTensorsGlobalScaleIsChecked) {
  auto dir = compressed_tensors_copy(testutil::fixture_path("qwen3moe/model-nvfp4"));
  auto cfg = load_model_config(dir->str());
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  CpuBackend backend;
  const std::string e = "model.layers.1.mlp.experts.0.up_proj";
  for (float bad : {0.0f, -2.0f}) {
    auto d = testutil::edited_checkpoint(dir->str(), [&](auto& t) {
      t[e + ".weight_global_scale"] = testutil::f32_tensor({1}, {bad});
    });
    auto ck = Checkpoint::open(d->str());
    ASSERT_TRUE(ck.ok());
    auto w = load_model_weights(*ck, *cfg, backend);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("'" + e + ".weight_global_scale' is"), std::string::npos) << w.status().message();
  }
  auto both = testutil::edited_checkpoint(dir->str(), [&](auto& t) {
    t[e + ".weight"] = testutil::bf16_tensor({192, 128}, testutil::random_values(192 * 128, 9));
  });
  auto ck = Checkpoint::open(both->str());
  ASSERT_TRUE(ck.ok());
  auto w = load_model_weights(*ck, *cfg, backend);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("both '" + e + ".weight' and"), std::string::npos) << w.status().message();
}

}  // namespace
}  // namespace moelora

namespace moelora {
namespace {

// A CPU backend that reports a device of `free` bytes and counts what is uploaded.
class SmallDevice : public testutil::ForwardingCpuBackend {
 public:
  explicit SmallDevice(size_t free) : free_(free) {}
  std::string name() const override { return "small-device"; }
  bool device_memory(size_t* free, size_t* total) override {
    *free = free_;
    *total = 2 * free_;
    return true;
  }
  Tensor upload(const Tensor& host, DType dtype) override {
    ++uploads;
    return ForwardingCpuBackend::upload(host, dtype);
  }
  LinearWeight upload_linear(const StoredWeight& w) override {
    ++uploads;
    return ForwardingCpuBackend::upload_linear(w);
  }
  int uploads = 0;

 private:
  size_t free_;
};

TEST(WeightsThatDoNotFit, AreRefusedBeforeAnythingIsUploaded) {
  const std::string dir = testutil::fixture_path("qwen3moe/model-nvfp4");
  auto cfg = load_model_config(dir);
  ASSERT_TRUE(cfg.ok());
  auto ck = Checkpoint::open(dir);
  ASSERT_TRUE(ck.ok());
  SmallDevice probe(0);
  auto need = device_weight_bytes(*ck, *cfg, probe);
  ASSERT_TRUE(need.ok()) << need.status().message();
  EXPECT_EQ(probe.uploads, 0);
  // The CPU reference holds every linear in f32: vocab x hidden for the embedding and lm_head alone.
  EXPECT_GT(*need, size_t{2} * 256 * 128 * 4);

  SmallDevice tight(*need - 1);
  auto refused = load_model_weights(*ck, *cfg, tight);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("the weights take"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("NVFP4 is held as bf16"), std::string::npos);
  EXPECT_EQ(tight.uploads, 0);

  SmallDevice exact(*need);
  EXPECT_TRUE(load_model_weights(*ck, *cfg, exact).ok());
  EXPECT_GT(exact.uploads, 0);

  // What the backend will derive from the weights on first use counts as well (absorbed MLA's kv_b
  // copies on CUDA): the same device with room for the weights alone is refused, naming it.
  SmallDevice weights_only(*need);
  auto derived = load_model_weights(*ck, *cfg, weights_only, 1 << 20);
  ASSERT_FALSE(derived.ok());
  EXPECT_EQ(derived.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(derived.status().message().find("derived by the backend"), std::string::npos) << derived.status().message();
  EXPECT_EQ(weights_only.uploads, 0);
}

}  // namespace
}  // namespace moelora
