// DeepSeek-V3's MLA in the absorbed form (latent KV cache) against the decompressed form, on the
// fixture checkpoints (bf16 and FP8) with their adapters (kv_b LoRA of ranks 8 and 16, one adapter
// without kv_b) plus two in-memory ones: a kv_b-only adapter of rank 3 whose effect on the logits
// is large, and a random adapter of rank 5 on every target. One batch mixes all of them and the
// base model, prefill (longer prompts in two chunks) then four decode steps.
//
// Bound (docs/numerics.md, "MLA absorbed"): both forms accumulate in float64; they differ only in
// what is rounded to float32 on the way (the decompressed form stores kv_b's output k_nope / v,
// the absorbed one keeps W_UK^T q and the latent output in float64), ~1e-7 relative per value.
// Through two layers that was at most 2.35e-7 of a logits row (bf16 and FP8 checkpoints, every
// step); 2e-6 leaves ~8x margin, as the sharded bound does for the same kind of difference, while
// dropping a kv_b LoRA moves rows by 0.6 to 1.05 of their norm (asserted below: the comparison
// can fail).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "lora/adapter.h"
#include "lora/random_adapter.h"
#include "lora/slot_pool.h"
#include "model/model.h"
#include "tests/testutil/forwarding_backend.h"
#include "tests/testutil/scripted_steps.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

constexpr double kMaxRowRelError = 2e-6;

// Worst row of ||a - b|| / ||b||.
double worst_row_rel(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.cols(), b.cols());
  double worst = 0;
  for (int64_t r = 0; r < b.rows(); ++r) {
    double num = 0, den = 0;
    for (int64_t v = 0; v < b.cols(); ++v) {
      const double x = a.ptr<float>()[r * a.cols() + v], y = b.ptr<float>()[r * b.cols() + v];
      num += (x - y) * (x - y);
      den += y * y;
    }
    const double rel = std::sqrt(num / den);
    worst = std::max(worst, std::isfinite(rel) ? rel : INFINITY);
  }
  return worst;
}

// Only `keep` targets of `a` (every other factor and the experts' dropped), under a new name.
std::shared_ptr<const LoraAdapter> only(const LoraAdapter& a, const std::string& name, std::vector<LoraTarget> keep) {
  auto out = std::make_shared<LoraAdapter>(a);
  out->name = name;
  for (auto& layer : out->dense)
    for (int t = 0; t < kNumLoraTargets; ++t)
      if (std::find(keep.begin(), keep.end(), static_cast<LoraTarget>(t)) == keep.end()) layer[t] = LoraFactor{};
  for (ExpertLora& x : out->experts) x = ExpertLora{};
  return out;
}

// `a` without its kv_b LoRA.
std::shared_ptr<const LoraAdapter> without_kv_b(const LoraAdapter& a, const std::string& name) {
  auto out = std::make_shared<LoraAdapter>(a);
  out->name = name;
  for (auto& layer : out->dense) layer[static_cast<int>(LoraTarget::kKVB)] = LoraFactor{};
  return out;
}

using Seq = testutil::ScriptedSeq;

// Prefill of every sequence (prompts longer than 6 tokens in two chunks), then `decode` steps.
// Fed tokens depend on the prompt only, so sequences of one prompt differ only by adapter.
std::vector<StepBatch> make_steps(const std::vector<Seq>& seqs, int vocab, int page_size, int decode, int* pages_out) {
  testutil::ScriptedSteps r = testutil::scripted_steps(seqs, page_size, decode, 6, [&](int d, int s) {
    return static_cast<int32_t>((13 * d + 7 * seqs[s].prompt.size() + 1) % vocab);
  });
  *pages_out = r.num_pages;
  return std::move(r.steps);
}

std::unique_ptr<Model> load(const std::string& rel, Backend& b, MlaMode mode) {
  auto m = Model::load(testutil::fixture_path(rel), b, ModelOptions{mode});
  EXPECT_TRUE(m.ok()) << m.status().message();
  return m.ok() ? std::move(m).value() : nullptr;
}

class MlaForms : public ::testing::TestWithParam<std::string> {};

TEST_P(MlaForms, AbsorbedDecodeLogitsMatchDecompressedWithKvbLoraAdapters) {
  const std::string rel = GetParam();
  const std::string arch_dir = testutil::fixture_path(rel).substr(0, testutil::fixture_path(rel).rfind('/'));
  CpuBackend backend;
  auto absorbed = load(rel, backend, MlaMode::kAbsorbed);
  auto decompressed = load(rel, backend, MlaMode::kDecompressed);
  ASSERT_TRUE(absorbed && decompressed);
  ASSERT_TRUE(absorbed->mla_absorbed());
  ASSERT_FALSE(decompressed->mla_absorbed());
  const ModelConfig& cfg = absorbed->config();

  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
  for (const char* n : {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"}) {
    auto a = load_lora_adapter(arch_dir + "/adapters/" + n, n, cfg);
    ASSERT_TRUE(a.ok()) << a.status().message();
    adapters.push_back(*a);
  }
  const auto kvb_only = only(*make_random_adapter(cfg, "kvb-only-r3", 3, 11, 0.2f), "kvb-only-r3", {LoraTarget::kKVB});
  adapters.push_back(kvb_only);
  adapters.push_back(make_random_adapter(cfg, "random-r5", 5, 12, 0.05f));
  adapters.push_back(without_kv_b(*kvb_only, "kvb-only-r3-dropped"));  // == the base model
  adapters.push_back(without_kv_b(*adapters[0], "attn-r8-without-kvb"));
  // Both models run on one backend, so one slot pool serves them.
  LoraSlotPool pool(cfg, backend, static_cast<int>(adapters.size()));
  std::vector<int> slots;
  for (const auto& a : adapters) {
    auto s = pool.acquire(a);
    ASSERT_TRUE(s.ok()) << s.status().message();
    slots.push_back(*s);
  }
  const std::vector<std::vector<int32_t>> prompts = {{5}, {1, 2, 3}, {9, 8, 7, 6, 5, 4, 3, 200, 100, 50, 25, 12, 6}};
  std::vector<Seq> seqs;
  for (const auto& p : prompts) {
    seqs.push_back({p, -1});
    for (int s : slots) seqs.push_back({p, s});
  }
  const int P = 4, decode = 4;
  int num_pages = 0;
  const std::vector<StepBatch> steps = make_steps(seqs, cfg.vocab_size, P, decode, &num_pages);

  auto kv_a = absorbed->alloc_kv_cache(num_pages, P);
  auto kv_d = decompressed->alloc_kv_cache(num_pages, P);
  // The absorbed cache holds the latent: one head of kv_lora_rank + rope values, no V.
  ASSERT_EQ(kv_a.size(), static_cast<size_t>(cfg.num_layers));
  EXPECT_EQ(kv_a[0].kv_heads, 1);
  EXPECT_EQ(kv_a[0].k_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim);
  EXPECT_EQ(kv_a[0].v_head_dim, 0);
  EXPECT_EQ(kv_a[0].k.numel(), int64_t{num_pages} * P * (cfg.kv_lora_rank + cfg.qk_rope_head_dim));
  EXPECT_EQ(kv_d[0].kv_heads, cfg.num_heads);

  double worst = 0;
  std::vector<Tensor> logits;
  for (const StepBatch& b : steps) {
    Tensor la = absorbed->forward(b, kv_a, &pool.tables());
    Tensor ld = decompressed->forward(b, kv_d, &pool.tables());
    const double w = worst_row_rel(la, ld);
    EXPECT_LE(w, kMaxRowRelError);
    worst = std::max(worst, w);
    logits.push_back(la);
  }
  std::printf("[ mla      ] %s: absorbed vs decompressed, worst logits row relative difference %.2e\n", rel.c_str(),
              worst);
  RecordProperty("worst_row_rel_diff", std::to_string(worst));

  // The comparison could fail: rows of a sequence on an adapter (last decode step) against the
  // same prompt on the base model. The kv_b-only adapter moves them, so its LoRA is applied in
  // the absorbed form; with its kv_b factors dropped the rows are the base model's exactly.
  const Tensor& last = logits.back();
  const int per_prompt = 1 + static_cast<int>(slots.size());
  const int base_row = 2 * per_prompt, V = cfg.vocab_size;  // third prompt, base model
  auto diff = [&](int r1, int r2) {
    double num = 0, den = 0;
    for (int v = 0; v < V; ++v) {
      const double x = last.ptr<float>()[int64_t{r1} * V + v], y = last.ptr<float>()[int64_t{r2} * V + v];
      num += (x - y) * (x - y);
      den += y * y;
    }
    return std::sqrt(num / den);
  };
  const int kvb_row = base_row + 1 + 5, dropped_row = base_row + 1 + 7;
  const int attn_row = base_row + 1 + 0, attn_without_row = base_row + 1 + 8;
  std::printf("[ mla      ] kv_b LoRA's effect on a row: kv_b-only r3 %.2e, attn-r8's kv_b %.2e\n",
              diff(kvb_row, base_row), diff(attn_row, attn_without_row));
  EXPECT_GT(diff(kvb_row, base_row), 1e-1) << "the kv_b-only adapter must move the logits";
  EXPECT_EQ(diff(dropped_row, base_row), 0.0);
  EXPECT_GT(diff(attn_row, attn_without_row), 1e-2) << "attn-r8's kv_b LoRA must matter";
}

INSTANTIATE_TEST_SUITE_P(DeepseekV3, MlaForms, ::testing::Values("deepseekv3/model-bf16", "deepseekv3/model-fp8"),
                         [](const auto& info) { return info.param == "deepseekv3/model-bf16" ? "bf16" : "fp8"; });

// The form is chosen once at load: auto is absorbed where the backend has the op (the CPU), a
// model without MLA ignores the option, and the KV cache follows the form.
TEST(MlaMode, AutoIsAbsorbedOnTheCpuAndTheCacheFollows) {
  CpuBackend backend;
  auto ds = load("deepseekv3/model-bf16", backend, MlaMode::kAuto);
  ASSERT_TRUE(ds);
  EXPECT_TRUE(ds->mla_absorbed());
  const ModelConfig& c = ds->config();
  EXPECT_EQ(ds->kv_shape().values_per_token(), c.kv_lora_rank + c.qk_rope_head_dim);
  auto qwen = load("qwen3moe/model-bf16", backend, MlaMode::kAbsorbed);
  ASSERT_TRUE(qwen);
  EXPECT_FALSE(qwen->mla_absorbed());
  const ModelConfig& q = qwen->config();
  EXPECT_EQ(qwen->kv_shape().values_per_token(), int64_t{q.num_kv_heads} * 2 * q.head_dim);
  EXPECT_EQ(parse_mla_mode("absorbed").value(), MlaMode::kAbsorbed);
  EXPECT_EQ(parse_mla_mode("decompressed").value(), MlaMode::kDecompressed);
  EXPECT_EQ(parse_mla_mode("auto").value(), MlaMode::kAuto);
  EXPECT_FALSE(parse_mla_mode("latent").ok());
}

// A backend without the absorbed op, as the CUDA backend is: the CPU's ops, Backend's defaults
// kept for supports_mla_absorbed and mla_attention_absorbed.
class NoAbsorbedBackend final : public testutil::ForwardingCpuBackend {
 public:
  std::string name() const override { return "no-absorbed"; }
};

// Such a backend refuses an explicit absorbed request at load, keeps the decompressed form under
// auto (the same program as the CPU's decompressed form, bit for bit), and its default op aborts.
TEST(MlaMode, ABackendWithoutTheOpKeepsTheDecompressedForm) {
  const std::string rel = "deepseekv3/model-fp8";
  const std::string arch_dir = testutil::fixture_path(rel).substr(0, testutil::fixture_path(rel).rfind('/'));
  NoAbsorbedBackend plain;
  auto refused = Model::load(testutil::fixture_path(rel), plain, ModelOptions{MlaMode::kAbsorbed});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no-absorbed backend has no absorbed MLA"), std::string::npos)
      << refused.status().message();
  auto model = load(rel, plain, MlaMode::kAuto);
  ASSERT_TRUE(model);
  EXPECT_FALSE(model->mla_absorbed());
  const ModelConfig& c = model->config();
  EXPECT_EQ(model->kv_shape().values_per_token(),
            int64_t{c.num_heads} * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim));

  CpuBackend cpu;
  auto reference = load(rel, cpu, MlaMode::kDecompressed);
  ASSERT_TRUE(reference);
  auto adapter = load_lora_adapter(arch_dir + "/adapters/full-r16", "full-r16", c);
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  LoraSlotPool pool_plain(c, plain, 1), pool_cpu(c, cpu, 1);
  const int slot = *pool_plain.acquire(*adapter);
  ASSERT_EQ(*pool_cpu.acquire(*adapter), slot);
  int num_pages = 0;
  const auto steps = make_steps({{{1, 2, 3, 4, 5, 6, 7, 8}, -1}, {{9, 8, 7}, slot}}, c.vocab_size, 4, 2, &num_pages);
  auto kv_plain = model->alloc_kv_cache(num_pages, 4);
  auto kv_cpu = reference->alloc_kv_cache(num_pages, 4);
  for (const StepBatch& b : steps) {
    Tensor got = model->forward(b, kv_plain, &pool_plain.tables());
    Tensor want = reference->forward(b, kv_cpu, &pool_cpu.tables());
    ASSERT_EQ(got.nbytes(), want.nbytes());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);
  }
}

TEST(MlaModeDeathTest, TheDefaultOpRefusesInsteadOfComputingSomethingElse) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  NoAbsorbedBackend plain;
  EXPECT_FALSE(plain.supports_mla_absorbed());
  KvLayer kv;
  EXPECT_DEATH(plain.mla_attention_absorbed(Tensor(), Tensor(), Tensor(), LinearWeight{}, nullptr, kv, 1, 1, 1, 1.0f,
                                            Tensor()),
               "not supported by the no-absorbed backend");
}

}  // namespace
}  // namespace moelora
