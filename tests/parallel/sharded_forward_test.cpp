// Sharded == unsharded: every fixture checkpoint (3 architectures x bf16/FP8) with all its
// adapters, split tp x ep ways (threads + FakeCommunicator), gives the logits of the single-device
// Model::forward on one batch mixing every adapter and the base model, prefill and decode.
// Tolerance (docs/numerics.md, "Sharded (TP/EP)"): the reduce adds float32 partials where the
// single device rounds one float64 sum once, ~1 ulp per reduced value; through 2 layers that was
// at most 2.5e-7 of a logits row. The bound 2e-6 keeps ~8x margin, is 50x below the 1e-4 the CPU
// path is verified to against float64, and a mis-sharded projection (a wrong head, slice, expert
// or adapter) moves a row by 1e-2 or more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "backends/cpu/cpu_backend.h"
#include "lora/adapter.h"
#include "lora/slot_pool.h"
#include "model/model.h"
#include "parallel/sharded_forward.h"
#include "tests/testutil/scripted_steps.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

constexpr double kMaxRowRelError = 2e-6;
const std::vector<std::string> kAdapters = {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"};

using Seq = testutil::ScriptedSeq;

// The steps of one run: a prefill of every sequence, then decode steps feeding fixed tokens.
std::vector<StepBatch> make_steps(const std::vector<Seq>& seqs, int vocab, int page_size, int* num_pages) {
  testutil::ScriptedSteps r = testutil::scripted_steps(
      seqs, page_size, /*decode=*/2, /*first_chunk=*/0,
      [&](int d, int s) { return static_cast<int32_t>((11 * d + 5 * s + 3) % vocab); });
  *num_pages = r.num_pages;
  return std::move(r.steps);
}

struct Checkpoint {
  std::string name;
  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<Model> model;
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
  std::vector<StepBatch> steps;
  int num_pages = 0;
  std::vector<Tensor> reference;  // single-device logits per step
};

constexpr int kPageSize = 8;

// Loads a fixture checkpoint, its adapters, and the single-device logits of the mixed batch.
// "<checkpoint>" loads in the default MLA form (auto: absorbed on the CPU, so DeepSeek-V3's ranks
// each cache the whole latent), "<checkpoint>:decompressed" in the decompressed one.
Checkpoint load_checkpoint(const std::string& name) {
  Checkpoint c;
  c.name = name;
  const size_t colon = name.find(':');
  const std::string rel = name.substr(0, colon);
  ModelOptions opts;
  if (colon != std::string::npos) opts.mla = parse_mla_mode(name.substr(colon + 1)).value();
  const std::string dir = testutil::fixture_path(rel);
  const std::string arch_dir = dir.substr(0, dir.rfind('/'));
  c.backend = std::make_unique<CpuBackend>();
  auto model = Model::load(dir, *c.backend, opts);
  EXPECT_TRUE(model.ok()) << model.status().message();
  if (!model.ok()) return c;
  c.model = std::move(model).value();
  for (const std::string& n : kAdapters) {
    auto a = load_lora_adapter(arch_dir + "/adapters/" + n, n, c.model->config());
    EXPECT_TRUE(a.ok()) << a.status().message();
    if (a.ok()) c.adapters.push_back(*a);
  }
  LoraSlotPool pool(c.model->config(), *c.backend, static_cast<int>(kAdapters.size()));
  std::vector<int> slots;
  for (const auto& a : c.adapters) slots.push_back(*pool.acquire(a));
  // Every adapter and the base model, prompts of different lengths, one sequence per pair.
  const std::vector<std::vector<int32_t>> prompts = {{5}, {1, 2, 3}, {9, 8, 7, 6, 5, 4, 3, 200, 100, 50, 25}};
  std::vector<Seq> seqs;
  for (const auto& p : prompts) {
    seqs.push_back({p, -1});
    for (int s : slots) seqs.push_back({p, s});
  }
  c.steps = make_steps(seqs, c.model->config().vocab_size, kPageSize, &c.num_pages);
  auto kv = c.model->alloc_kv_cache(c.num_pages, kPageSize);
  for (const StepBatch& b : c.steps) c.reference.push_back(c.model->forward(b, kv, &pool.tables()));
  return c;
}

// The six checkpoints, loaded once for the whole suite.
Checkpoint& checkpoint(const std::string& rel) {
  static std::map<std::string, Checkpoint> cache;
  auto it = cache.find(rel);
  if (it == cache.end()) it = cache.emplace(rel, load_checkpoint(rel)).first;
  return it->second;
}

// Worst row of ||sharded - unsharded|| / ||unsharded|| over every step of the run.
double run_sharded(Checkpoint& c, ShardedModel& sm, bool* bit_exact) {
  for (const auto& a : c.adapters) {
    auto s = sm.acquire(a);
    EXPECT_TRUE(s.ok());
  }
  sm.alloc_kv_cache(c.num_pages, kPageSize);
  double worst = 0;
  *bit_exact = true;
  for (size_t i = 0; i < c.steps.size(); ++i) {
    Tensor got = sm.forward(c.steps[i]);
    const Tensor& want = c.reference[i];
    EXPECT_EQ(got.rows(), want.rows());
    *bit_exact = *bit_exact && std::memcmp(got.data(), want.data(), want.nbytes()) == 0;
    for (int64_t r = 0; r < want.rows(); ++r) {
      double num = 0, den = 0;
      for (int64_t v = 0; v < want.cols(); ++v) {
        const double d = static_cast<double>(got.ptr<float>()[r * got.cols() + v]) - want.ptr<float>()[r * want.cols() + v];
        num += d * d;
        den += static_cast<double>(want.ptr<float>()[r * want.cols() + v]) * want.ptr<float>()[r * want.cols() + v];
      }
      const double rel = std::sqrt(num / den);
      worst = std::max(worst, std::isfinite(rel) ? rel : INFINITY);
    }
  }
  return worst;
}

struct Case {
  std::string checkpoint;
  int tp, ep;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.checkpoint << " tp " << c.tp << " ep " << c.ep; }

class ShardedForward : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedForward, LogitsMatchTheSingleDeviceForward) {
  const Case& p = GetParam();
  Checkpoint& c = checkpoint(p.checkpoint);
  ASSERT_TRUE(c.model) << "fixture did not load";
  auto sm = ShardedModel::create(*c.model, p.tp, p.ep, static_cast<int>(kAdapters.size()));
  ASSERT_TRUE(sm.ok()) << sm.status().message();
  bool bit_exact = false;
  const double worst = run_sharded(c, **sm, &bit_exact);
  std::printf("[ sharded  ] %-22s tp %d ep %d: worst row relative difference %.2e%s\n", p.checkpoint.c_str(), p.tp,
              p.ep, worst, bit_exact ? " (bit-exact)" : "");
  RecordProperty("worst_row_rel_diff", std::to_string(worst));
  EXPECT_LE(worst, kMaxRowRelError);
  // One rank holds everything: the sharded program must add nothing to the single-device one.
  if (p.tp == 1 && p.ep == 1) {
    EXPECT_TRUE(bit_exact);
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* ck : {"qwen3moe/model-bf16", "qwen3moe/model-fp8", "mixtral/model-bf16", "mixtral/model-fp8",
                         "deepseekv3/model-bf16", "deepseekv3/model-fp8"})
    for (int tp : {1, 2, 4})
      for (int ep : {1, 2, 4}) cases.push_back({ck, tp, ep});
  // An expert count the EP ranks do not divide (8 experts over 3 ranks: 2, 3 and 3).
  cases.push_back({"qwen3moe/model-bf16", 1, 3});
  cases.push_back({"deepseekv3/model-fp8", 2, 3});
  // The decompressed MLA form (per-head K/V caches cut by heads) stays covered too.
  cases.push_back({"deepseekv3/model-fp8:decompressed", 2, 2});
  cases.push_back({"deepseekv3/model-bf16:decompressed", 4, 1});
  // NVFP4 checkpoints: the cut happens after dequantisation, as for FP8.
  for (const char* ck : {"qwen3moe/model-nvfp4", "mixtral/model-nvfp4", "deepseekv3/model-nvfp4"})
    cases.push_back({ck, 2, 2});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ShardedForward, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  std::string n = info.param.checkpoint + "_tp" + std::to_string(info.param.tp) + "_ep" + std::to_string(info.param.ep);
  for (char& ch : n)
    if (ch == '/' || ch == '-' || ch == ':') ch = '_';
  return n;
});

// Shapes that do not divide are refused with a message naming the shape, for every architecture.
TEST(ShardedForwardRefusal, PlansTheShapesDoNotAllowAreRefusedClearly) {
  for (const char* ck : {"qwen3moe/model-bf16", "mixtral/model-bf16", "deepseekv3/model-bf16"}) {
    Checkpoint& c = checkpoint(ck);
    ASSERT_TRUE(c.model);
    const ModelConfig& cfg = c.model->config();
    auto tp8 = ShardedModel::create(*c.model, 8, 1, 1);  // 4 attention heads
    ASSERT_FALSE(tp8.ok()) << ck;
    EXPECT_NE(tp8.status().message().find("--tp 8 does not divide the model's 4 attention heads"), std::string::npos)
        << tp8.status().message();
    auto tp3 = ShardedModel::create(*c.model, 3, 1, 1);
    ASSERT_FALSE(tp3.ok()) << ck;
    auto ep_too_many = ShardedModel::create(*c.model, 1, cfg.num_experts + 1, 1);
    ASSERT_FALSE(ep_too_many.ok()) << ck;
    EXPECT_NE(ep_too_many.status().message().find("more ranks than the model's"), std::string::npos)
        << ep_too_many.status().message();
  }
}

}  // namespace
}  // namespace moelora
