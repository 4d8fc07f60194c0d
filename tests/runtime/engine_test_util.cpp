#include "engine_test_util.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "model/model.h"
#include "runtime/backend_factory.h"

namespace moelora::testing {

namespace fs = std::filesystem;

std::string tiny_model_dir() { return (fs::path(MOELORA_SOURCE_DIR) / "models" / "tiny-qwen3moe").string(); }

std::string adapter_dir(const std::string& name) {
  const fs::path bundled = fs::path(tiny_model_dir()) / "adapters" / name;
  if (fs::exists(bundled / "adapter_config.json")) return bundled.string();
  return (fs::path(MOELORA_SOURCE_DIR) / "tests" / "fixtures" / "qwen3moe" / "adapters" / name).string();
}

EngineOptions small_options(int slots) {
  EngineOptions o;
  o.max_num_seqs = 16;
  o.max_batch_tokens = 256;
  o.max_loras_per_batch = slots;
  o.max_loaded_loras = 2 * slots;
  o.max_model_len = 256;
  return o;
}

std::unique_ptr<Engine> make_engine(const EngineOptions& opts) {
  auto backend = make_backend(BackendOptions{});
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  auto model = Model::load(tiny_model_dir(), **backend);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  auto engine = Engine::create(std::move(backend).value(), std::move(model).value(), opts);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return std::move(engine).value();
}

Status Collector::submit(const std::string& id, std::vector<int32_t> prompt, const std::string& adapter,
                         const SamplingParams& sampling) {
  GenerationRequest req;
  req.id = id;
  req.prompt = std::move(prompt);
  req.adapter = adapter;
  req.sampling = sampling;
  bool existed = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    existed = outcomes_.count(id) != 0;
    ++pending_;
    if (!existed) outcomes_[id] = {};
  }
  Status s = engine_.submit(std::move(req), [this, id](const RequestOutput& o) {
    std::lock_guard<std::mutex> lk(mu_);
    Outcome& out = outcomes_[id];
    for (const TokenEvent& t : o.tokens) out.tokens.push_back(t.token);
    if (o.finished) {
      out.final = o;
      --pending_;
    }
    cv_.notify_all();
  });
  if (!s.ok()) {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_;
    if (!existed) outcomes_.erase(id);
  }
  return s;
}

void Collector::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  const bool done = cv_.wait_for(lk, std::chrono::seconds(120), [&] { return pending_ == 0; });
  ASSERT_TRUE(done) << pending_ << " request(s) never finished";
}

bool Collector::wait_for_tokens(const std::string& id, int n, int timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] {
    const Outcome& o = outcomes_[id];
    return static_cast<int>(o.tokens.size()) >= n || o.final.finished;
  });
}

Outcome Collector::get(const std::string& id) {
  std::lock_guard<std::mutex> lk(mu_);
  return outcomes_[id];
}

Outcome run_alone(Engine& engine, const std::vector<int32_t>& prompt, const std::string& adapter,
                  const SamplingParams& sampling) {
  Collector c(engine);
  Status s = c.submit("alone", prompt, adapter, sampling);
  EXPECT_TRUE(s.ok()) << s.to_string();
  c.wait();
  return c.get("alone");
}

SamplingParams greedy(int max_tokens) {
  SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  return s;
}

std::vector<int32_t> test_prompt(int length, int salt) {
  std::vector<int32_t> p;
  uint32_t x = 2166136261u ^ static_cast<uint32_t>(salt * 7919);
  for (int i = 0; i < length; ++i) {
    x = x * 1664525u + 1013904223u;
    p.push_back(static_cast<int32_t>((x >> 8) % 256));
  }
  return p;
}

void expect_no_leaks(Engine& engine) {
  EngineStats s;
  for (int i = 0; i < 200; ++i) {
    s = engine.stats();
    if (s.num_running == 0 && s.num_waiting == 0 && s.kv_pages_used == 0 && s.lora_slots_used == 0 &&
        s.penalty_slots_used == 0)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.num_running, 0);
  EXPECT_EQ(s.num_waiting, 0);
  EXPECT_EQ(s.kv_pages_used, 0) << "KV pages leaked";
  EXPECT_EQ(s.lora_slots_used, 0) << "adapter slots leaked";
  EXPECT_EQ(s.penalty_slots_used, 0) << "penalty slots leaked";
}

}  // namespace moelora::testing
