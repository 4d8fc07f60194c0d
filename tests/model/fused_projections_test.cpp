// Fused projections (model/fused_projections.h): q|k|v, q_a|kv_a and gate|up in one weight each. The fused
// layout rule (fused_split_rows), the CPU backend's concatenation, and the whole model: a mixed
// batch of every adapter gives bit-identical logits fused and unfused, for every architecture.
#include <gtest/gtest.h>

#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "lora/adapter.h"
#include "lora/slot_pool.h"
#include "model/model.h"
#include "tests/testutil/forwarding_backend.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

LinearWeight shaped(int out, int in, int block_out = 128) {
  LinearWeight w;
  w.w = Tensor::empty_host(DType::kF32, {out, in});
  w.out = out;
  w.in = in;
  w.block_out = block_out;
  return w;
}

TEST(FusedSplitRows, OnlyTheLastBoundaryMayFallInsideAScaleBlock) {
  const LinearWeight q = shaped(256, 64), k = shaped(128, 64), v = shaped(128, 64), small = shaped(64, 64);
  EXPECT_EQ(fused_split_rows({&q, &k, &v}, true), 0);         // every boundary on a block
  EXPECT_EQ(fused_split_rows({&q, &small, &v}, true), 320);   // the last one inside: split there
  EXPECT_EQ(fused_split_rows({&small, &k, &v}, true), -1);    // an earlier one inside: no
  EXPECT_EQ(fused_split_rows({&small, &k, &v}, false), 0);    // dense weights: always
  EXPECT_EQ(fused_split_rows({&small, &v}, true), 64);        // two parts: gate|up with any I
  EXPECT_EQ(fused_split_rows({&q}, false), -1);               // nothing to fuse
  LinearWeight other_in = shaped(128, 32), split = shaped(128, 64), blocks = shaped(128, 64, 64);
  split.split_rows = 64;
  EXPECT_EQ(fused_split_rows({&q, &other_in}, false), -1);
  EXPECT_EQ(fused_split_rows({&q, &split}, false), -1);
  EXPECT_EQ(fused_split_rows({&q, &blocks}, true), -1);
  LinearWeight undefined;
  undefined.out = 128, undefined.in = 64;
  EXPECT_EQ(fused_split_rows({&q, &undefined}, false), -1);
}

TEST(FusedProjections, TheCpuBackendConcatenatesRows) {
  CpuBackend cpu;
  LinearWeight a = shaped(2, 3), b = shaped(1, 3);
  for (int i = 0; i < 6; ++i) a.w.ptr<float>()[i] = static_cast<float>(i);
  for (int i = 0; i < 3; ++i) b.w.ptr<float>()[i] = 10.0f + static_cast<float>(i);
  const LinearWeight f = cpu.fuse_linear_rows({&a, &b});
  ASSERT_TRUE(f.defined());
  EXPECT_EQ(f.out, 3);
  EXPECT_EQ(f.in, 3);
  EXPECT_EQ(f.split_rows, 0);
  const std::vector<float> want = {0, 1, 2, 3, 4, 5, 10, 11, 12};
  EXPECT_EQ(std::vector<float>(f.w.ptr<float>(), f.w.ptr<float>() + 9), want);
  const LinearWeight wide = shaped(1, 4);
  EXPECT_FALSE(cpu.fuse_linear_rows({&a, &wide}).defined());
}

// The CPU reference with fusion turned off: the forward pass takes the separate projections.
// (It keeps the absorbed MLA op, so both models run DeepSeek in the same form.)
class UnfusedCpuBackend final : public testutil::ForwardingCpuBackend {
 public:
  std::string name() const override { return "cpu-unfused"; }
  LinearWeight fuse_linear_rows(const std::vector<const LinearWeight*>&) override { return {}; }
  bool supports_mla_absorbed() const override { return true; }
  void mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe, const LinearWeight& kv_b,
                              const LoraModuleTable* lora, KvLayer& kv, int heads, int nope, int v_dim, float scale,
                              Tensor out) override {
    cpu_.mla_attention_absorbed(q, latent, k_pe, kv_b, lora, kv, heads, nope, v_dim, scale, out);
  }
};

// Logits of every prompt position, then of one decode token per sequence, for a batch that puts
// each prompt under the base model and under every adapter.
std::vector<float> run_mixed(Model& model, const LoraTables& tables, const std::vector<int>& slots) {
  const std::vector<std::vector<int32_t>> prompts = {{5}, {9, 8, 7, 6, 5, 4, 3}, {200, 100, 50, 25, 12, 6, 3, 1, 0}};
  std::vector<int> seq_slot;
  for (size_t p = 0; p < prompts.size(); ++p) {
    seq_slot.push_back(-1);
    for (int s : slots) seq_slot.push_back(s);
  }
  const int P = 16;
  StepBatch b;
  for (size_t s = 0; s < seq_slot.size(); ++s) {
    b.seq_pages.push_back({static_cast<int32_t>(s)});
    const auto& prompt = prompts[s / (slots.size() + 1)];
    for (size_t i = 0; i < prompt.size(); ++i) {
      b.logit_rows.push_back(b.num_tokens());
      b.token_ids.push_back(prompt[i]);
      b.positions.push_back(static_cast<int>(i));
      b.token_seq.push_back(static_cast<int>(s));
      b.token_slot.push_back(seq_slot[s]);
    }
  }
  auto kv = model.alloc_kv_cache(static_cast<int>(seq_slot.size()), P);
  Tensor prefill = model.forward(b, kv, &tables);
  std::vector<float> out(prefill.ptr<float>(), prefill.ptr<float>() + prefill.numel());
  StepBatch d;
  d.seq_pages = b.seq_pages;
  for (size_t s = 0; s < seq_slot.size(); ++s) {
    d.logit_rows.push_back(d.num_tokens());
    d.token_ids.push_back(static_cast<int32_t>(3 * s + 1));
    d.positions.push_back(static_cast<int>(prompts[s / (slots.size() + 1)].size()));
    d.token_seq.push_back(static_cast<int>(s));
    d.token_slot.push_back(seq_slot[s]);
  }
  Tensor decode = model.forward(d, kv, &tables);
  out.insert(out.end(), decode.ptr<float>(), decode.ptr<float>() + decode.numel());
  return out;
}

class FusedModel : public ::testing::TestWithParam<std::string> {};

TEST_P(FusedModel, GivesTheUnfusedLogitsBitForBit) {
  const std::string model_dir = testutil::fixture_path(GetParam());
  const std::string arch_dir = model_dir.substr(0, model_dir.rfind('/'));
  CpuBackend fusing;
  UnfusedCpuBackend plain;
  auto fused = Model::load(model_dir, fusing);
  auto unfused = Model::load(model_dir, plain);
  ASSERT_TRUE(fused.ok() && unfused.ok()) << (fused.ok() ? unfused.status() : fused.status()).message();
  ASSERT_EQ((*fused)->mla_absorbed(), (*unfused)->mla_absorbed());
  const ModelConfig& cfg = (*fused)->config();
  // What fuses where: q|k|v in GQA layers, q_a|kv_a in MLA ones, gate|up in dense MLP layers and
  // shared experts.
  int fused_layers = 0;
  for (size_t l = 0; l < (*fused)->weights().layers.size(); ++l) {
    const LayerWeights& f = (*fused)->weights().layers[l];
    const LayerWeights& u = (*unfused)->weights().layers[l];
    EXPECT_EQ(f.attn.qkv.defined(), !cfg.is_mla());
    EXPECT_EQ(f.attn.q_a_kv_a.defined(), cfg.is_mla() && cfg.q_lora_rank > 0);
    EXPECT_EQ(f.mlp.gate_up.defined(), !f.is_moe);
    EXPECT_EQ(f.shared.gate_up.defined(), f.has_shared);
    EXPECT_FALSE(u.attn.qkv.defined() || u.attn.q_a_kv_a.defined() || u.mlp.gate_up.defined() ||
                 u.shared.gate_up.defined());
    fused_layers += f.attn.qkv.defined() || f.attn.q_a_kv_a.defined() || f.mlp.gate_up.defined() ||
                    f.shared.gate_up.defined();
  }
  EXPECT_GT(fused_layers, 0);
  std::vector<float> logits[2];
  Model* models[2] = {fused->get(), unfused->get()};
  Backend* backends[2] = {&fusing, &plain};
  for (int m = 0; m < 2; ++m) {
    LoraSlotPool pool(cfg, *backends[m], 8);
    std::vector<int> slots;
    for (const std::string n : {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern"}) {
      auto a = load_lora_adapter(arch_dir + "/adapters/" + n, n, cfg);
      ASSERT_TRUE(a.ok()) << a.status().message();
      auto s = pool.acquire(*a);
      ASSERT_TRUE(s.ok());
      slots.push_back(*s);
    }
    logits[m] = run_mixed(*models[m], pool.tables(), slots);
  }
  ASSERT_EQ(logits[0].size(), logits[1].size());
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FusedModel,
                         ::testing::Values("qwen3moe/model-bf16", "mixtral/model-fp8", "deepseekv3/model-bf16",
                                           "deepseekv3/model-fp8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '/' || c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace moelora
