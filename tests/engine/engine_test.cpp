// The engine end to end on the CPU: greedy continuations equal the Hugging Face reference's, and a
// request's tokens (greedy or seeded sampling) do not depend on what else shares its batches.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "backends/cpu/cpu_backend.h"
#include "io/json_util.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "runtime/engine.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

using testutil::fixture_path;

std::unique_ptr<Engine> make_engine(const std::string& arch, const std::string& ckpt, EngineOptions opts = {}) {
  auto backend = std::make_unique<CpuBackend>();
  auto model = Model::load(fixture_path(arch + "/" + ckpt), *backend);
  EXPECT_TRUE(model.ok()) << model.status().message();
  if (opts.max_loras_per_batch == EngineOptions{}.max_loras_per_batch) opts.max_loras_per_batch = 5;
  auto e = Engine::create(std::move(backend), std::move(model).value(), opts);
  EXPECT_TRUE(e.ok()) << e.status().message();
  for (const char* n : {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"})
    EXPECT_TRUE((*e)->load_adapter(n, fixture_path(arch + "/adapters/" + n)).ok());
  return std::move(e).value();
}

// Submits all requests at once and waits for every one to finish.
std::vector<std::vector<int32_t>> run_all(Engine& engine, std::vector<GenerationRequest> reqs) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int32_t>> out(reqs.size());
  int pending = static_cast<int>(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Status s = engine.submit(reqs[i], [&, i](const RequestOutput& o) {
      std::lock_guard<std::mutex> lk(mu);
      for (const auto& t : o.tokens) out[i].push_back(t.token);
      if (o.finished) {
        EXPECT_NE(o.reason, FinishReason::kError) << o.error.message();
        --pending;
        cv.notify_all();
      }
    });
    EXPECT_TRUE(s.ok()) << s.message();
  }
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return pending == 0; });
  return out;
}

class EngineFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineFixture, GreedyContinuationsMatchTheReferenceWhereTheMarginIsClear) {
  const std::string arch = GetParam();
  auto engine = make_engine(arch, "model-bf16");
  auto text = read_text_file(fixture_path(arch + "/cases.json"));
  ASSERT_TRUE(text.ok());
  auto cases = parse_json_strict(*text, "cases.json");
  ASSERT_TRUE(cases.ok());
  auto expected = SafetensorsFile::open(fixture_path(arch + "/expected-bf16.safetensors"));
  ASSERT_TRUE(expected.ok());
  std::vector<GenerationRequest> reqs;
  std::vector<std::string> ids;
  for (const Json& c : (*cases)["checkpoints"]["bf16"]["cases"]) {
    GenerationRequest r;
    r.id = c["id"].get<std::string>();
    r.prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    r.adapter = c["adapter"].is_null() ? "" : c["adapter"].get<std::string>();
    r.sampling.temperature = 0;
    r.sampling.max_tokens = c["new_tokens"].get<int>();
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
    ids.push_back(r.id);
  }
  const auto got = run_all(*engine, reqs);
  int compared = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Tensor want = *(*expected)->tensor(ids[i] + ".gen_ids");
    Tensor logits = to_f32(*(*expected)->tensor(ids[i] + ".gen_logits"));
    const int V = static_cast<int>(logits.dim(1));
    ASSERT_EQ(got[i].size(), static_cast<size_t>(want.numel()));
    for (int64_t s = 0; s < want.numel(); ++s) {
      // Stop at the first near-tie: past it a float32 engine may legitimately pick the other token.
      std::vector<float> row(logits.ptr<float>() + s * V, logits.ptr<float>() + (s + 1) * V);
      std::vector<float> sorted = row;
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      double rms = 0;
      for (float v : row) rms += static_cast<double>(v) * v;
      rms = std::sqrt(rms / V);
      if (sorted[0] - sorted[1] < 1e-3 * rms) break;
      EXPECT_EQ(got[i][s], read_as_i64(want, s)) << ids[i] << " step " << s;
      ++compared;
    }
  }
  EXPECT_GT(compared, static_cast<int>(reqs.size()) * 4);
}

TEST_P(EngineFixture, SeededSamplingDoesNotDependOnTheBatch) {
  const std::string arch = GetParam();
  auto engine = make_engine(arch, "model-fp8");
  std::vector<GenerationRequest> reqs;
  const std::vector<std::string> adapters = {"", "attn-r8", "full-r16", "mlp-rslora-r4", "pattern", "full-r16-per-expert"};
  for (size_t i = 0; i < 12; ++i) {
    GenerationRequest r;
    r.id = "r" + std::to_string(i);
    for (size_t t = 0; t < 3 + 5 * i; ++t) r.prompt.push_back(static_cast<int32_t>((t * 37 + i * 11) % 256));
    r.adapter = adapters[i % adapters.size()];
    r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.9f;
    r.sampling.top_k = i % 2 ? 40 : 0;
    r.sampling.top_p = i % 4 == 1 ? 0.8f : 1.0f;
    r.sampling.seed = 1000 + i;
    r.sampling.max_tokens = 12;
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
  }
  const auto together = run_all(*engine, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenerationRequest alone = reqs[i];
    alone.id += "-alone";
    EXPECT_EQ(run_all(*engine, {alone})[0], together[i]) << "request " << i << " adapter " << reqs[i].adapter;
  }
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, EngineFixture, ::testing::Values("qwen3moe", "mixtral", "deepseekv3"));

TEST(Engine, RejectsBadRequestsWithClearErrors) {
  auto engine = make_engine("qwen3moe", "model-bf16");
  auto submit = [&](GenerationRequest r) { return engine->submit(r, [](const RequestOutput&) {}); };
  GenerationRequest ok;
  ok.id = "x";
  ok.prompt = {1, 2, 3};
  GenerationRequest r = ok;
  r.adapter = "nope";
  EXPECT_EQ(submit(r).code(), ErrorCode::kNotFound);
  r = ok;
  r.prompt.clear();
  EXPECT_EQ(submit(r).code(), ErrorCode::kInvalidArgument);
  r = ok;
  r.prompt = {999};
  EXPECT_NE(submit(r).message().find("outside the vocabulary"), std::string::npos);
  r = ok;
  r.sampling.max_tokens = 0;
  EXPECT_NE(submit(r).message().find("max_tokens"), std::string::npos);
  r = ok;
  r.sampling.max_tokens = 600;
  EXPECT_NE(submit(r).message().find("maximum context length is 512 tokens"), std::string::npos);
  r = ok;
  r.sampling.top_p = 0;
  EXPECT_NE(submit(r).message().find("top_p"), std::string::npos);
}

TEST(Engine, TinyKvCachePreemptsAndStillProducesTheSameTokens) {
  EngineOptions small;
  small.kv_num_pages = 12;  // 192 positions for 8 requests of ~40 tokens each: forces preemption
  small.max_loras_per_batch = 5;
  auto tight = make_engine("mixtral", "model-bf16", small);
  auto roomy = make_engine("mixtral", "model-bf16");
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    GenerationRequest r;
    r.id = "p" + std::to_string(i);
    for (int t = 0; t < 20 + i; ++t) r.prompt.push_back((t * 13 + i) % 256);
    r.adapter = i % 2 ? "full-r16" : "";
    r.sampling.temperature = 0;
    r.sampling.max_tokens = 20;
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
  }
  EXPECT_EQ(run_all(*tight, reqs), run_all(*roomy, reqs));
  EXPECT_GT(tight->stats().num_preemptions_total, 0u);
  const EngineStats s = tight->stats();
  EXPECT_EQ(s.kv_pages_used, 0);
  EXPECT_EQ(s.lora_slots_used, 0);
}

}  // namespace
}  // namespace moelora
