// Isolation invariant on the CPU: a batch that mixes every adapter and the base model reproduces
// each request run alone, bit for bit (prefill and decode, all three architectures, bf16 and FP8;
// DeepSeek-V3 in both MLA forms: the absorbed one applies each token's kv_b LoRA inside attention).
#include <gtest/gtest.h>

#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "io/json_util.h"
#include "io/mapped_file.h"
#include "lora/adapter.h"
#include "lora/slot_pool.h"
#include "model/model.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

struct Req {
  std::vector<int32_t> prompt;
  int slot;  // -1 = base
  int id;    // decides the decode tokens fed to this request
};

// Runs `reqs` as one batch: prefill, then 3 decode steps feeding fixed tokens. Returns every
// logits row produced, per request, in order.
std::vector<std::vector<float>> run_batch(Model& model, const LoraTables& tables, const std::vector<Req>& reqs) {
  const int P = 16, V = model.config().vocab_size, decode_steps = 3;
  std::vector<std::vector<int32_t>> pages(reqs.size());
  int next = 0;
  for (size_t s = 0; s < reqs.size(); ++s)
    for (int p = 0; p < (static_cast<int>(reqs[s].prompt.size()) + decode_steps + P - 1) / P; ++p)
      pages[s].push_back(next++);
  auto kv = model.alloc_kv_cache(next, P);
  std::vector<std::vector<float>> out(reqs.size());
  StepBatch b;
  b.seq_pages = pages;
  for (size_t s = 0; s < reqs.size(); ++s)
    for (size_t i = 0; i < reqs[s].prompt.size(); ++i) {
      b.logit_rows.push_back(b.num_tokens());
      b.token_ids.push_back(reqs[s].prompt[i]);
      b.positions.push_back(static_cast<int>(i));
      b.token_seq.push_back(static_cast<int>(s));
      b.token_slot.push_back(reqs[s].slot);
    }
  Tensor logits = model.forward(b, kv, &tables);
  int row = 0;
  for (size_t s = 0; s < reqs.size(); ++s)
    for (size_t i = 0; i < reqs[s].prompt.size(); ++i, ++row)
      out[s].insert(out[s].end(), logits.ptr<float>() + static_cast<int64_t>(row) * V,
                    logits.ptr<float>() + static_cast<int64_t>(row + 1) * V);
  for (int d = 0; d < decode_steps; ++d) {
    StepBatch step;
    step.seq_pages = pages;
    for (size_t s = 0; s < reqs.size(); ++s) {
      step.logit_rows.push_back(step.num_tokens());
      step.token_ids.push_back((7 * d + 3 * reqs[s].id) % V);
      step.positions.push_back(static_cast<int>(reqs[s].prompt.size()) + d);
      step.token_seq.push_back(static_cast<int>(s));
      step.token_slot.push_back(reqs[s].slot);
    }
    Tensor l = model.forward(step, kv, &tables);
    for (size_t s = 0; s < reqs.size(); ++s)
      out[s].insert(out[s].end(), l.ptr<float>() + static_cast<int64_t>(s) * V, l.ptr<float>() + static_cast<int64_t>(s + 1) * V);
  }
  return out;
}

struct Fixture {
  std::string checkpoint;
  MlaMode mla;
};

void PrintTo(const Fixture& f, std::ostream* os) {
  *os << f.checkpoint;
  if (f.checkpoint.rfind("deepseekv3", 0) == 0) *os << " (MLA " << mla_mode_name(f.mla) << ")";
}

class Isolation : public ::testing::TestWithParam<Fixture> {};

TEST_P(Isolation, MixedBatchEqualsEachRequestAloneBitForBit) {
  const std::string model_dir = testutil::fixture_path(GetParam().checkpoint);
  const std::string arch_dir = model_dir.substr(0, model_dir.rfind('/'));
  CpuBackend backend;
  auto model = Model::load(model_dir, backend, ModelOptions{GetParam().mla});
  ASSERT_TRUE(model.ok()) << model.status().message();
  ASSERT_EQ((*model)->mla_absorbed(), GetParam().mla == MlaMode::kAbsorbed);
  const ModelConfig& cfg = (*model)->config();
  const std::vector<std::string> names = {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"};
  // Slots deliberately not in load order: slot numbers must not matter.
  LoraSlotPool pool(cfg, backend, 8);
  std::vector<int> slots;
  for (const std::string& n : names) {
    auto a = load_lora_adapter(arch_dir + "/adapters/" + n, n, cfg);
    ASSERT_TRUE(a.ok()) << a.status().message();
    auto s = pool.acquire(*a);
    ASSERT_TRUE(s.ok());
    slots.push_back(*s);
  }
  std::vector<Req> reqs;
  const std::vector<std::vector<int32_t>> prompts = {{5}, {1, 2, 3}, {9, 8, 7, 6, 5, 4, 3}, {200, 100, 50, 25, 12, 6, 3, 1, 0, 255, 128, 64, 32, 16, 8, 4, 2}};
  for (size_t p = 0; p < prompts.size(); ++p) {
    reqs.push_back({prompts[p], -1, static_cast<int>(reqs.size())});
    for (int s : slots) reqs.push_back({prompts[p], s, static_cast<int>(reqs.size())});
  }
  const auto mixed = run_batch(**model, pool.tables(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto alone = run_batch(**model, pool.tables(), {reqs[i]});
    ASSERT_EQ(alone[0].size(), mixed[i].size());
    EXPECT_EQ(std::memcmp(alone[0].data(), mixed[i].data(), alone[0].size() * sizeof(float)), 0)
        << "request " << i << " (slot " << reqs[i].slot << ") differs when batched";
  }
  // And the adapters do change the output (so the comparison above could have failed).
  EXPECT_NE(std::memcmp(mixed[0].data(), mixed[1].data(), mixed[0].size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(
    AllFixtures, Isolation,
    ::testing::Values(Fixture{"qwen3moe/model-bf16", MlaMode::kDecompressed},
                      Fixture{"qwen3moe/model-fp8", MlaMode::kDecompressed},
                      Fixture{"mixtral/model-bf16", MlaMode::kDecompressed},
                      Fixture{"mixtral/model-fp8", MlaMode::kDecompressed},
                      Fixture{"deepseekv3/model-bf16", MlaMode::kAbsorbed},
                      Fixture{"deepseekv3/model-fp8", MlaMode::kAbsorbed},
                      Fixture{"deepseekv3/model-bf16", MlaMode::kDecompressed},
                      Fixture{"deepseekv3/model-fp8", MlaMode::kDecompressed},
                      Fixture{"qwen3moe/model-nvfp4", MlaMode::kDecompressed},
                      Fixture{"mixtral/model-nvfp4", MlaMode::kDecompressed},
                      Fixture{"deepseekv3/model-nvfp4", MlaMode::kAbsorbed}),
    [](const auto& info) {
      std::string n = info.param.checkpoint;
      for (char& c : n)
        if (c == '/' || c == '-') c = '_';
      // Models without MLA have one form; keep their names as they were.
      return n.rfind("deepseekv3", 0) == 0 ? n + "_" + mla_mode_name(info.param.mla) : n;
    });

}  // namespace
}  // namespace moelora
