// Helpers for engine tests: an engine over the bundled tiny model on the CPU backend, and
// synchronous ways to run requests through it.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace moelora::testing {

std::string tiny_model_dir();
// Adapter folders: the two bundled ones, then the fixture set used for load/unload tests.
std::string adapter_dir(const std::string& name);  // attn-r8, full-r16, mlp-rslora-r4, pattern

std::unique_ptr<Engine> make_engine(const EngineOptions& opts);
// A small engine: 16 sequences, 256-token steps and context, `slots` adapter slots (twice as many
// adapters on the host).
EngineOptions small_options(int slots = 4);

struct Outcome {
  std::vector<int32_t> tokens;
  RequestOutput final;
};

// Collects the outputs of requests submitted with submit(); wait() blocks until all finished.
class Collector {
 public:
  explicit Collector(Engine& engine) : engine_(engine) {}
  Status submit(const std::string& id, std::vector<int32_t> prompt, const std::string& adapter,
                const SamplingParams& sampling);
  void wait();
  bool wait_for_tokens(const std::string& id, int n, int timeout_ms);
  Outcome get(const std::string& id);

 private:
  Engine& engine_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Outcome> outcomes_;
  int pending_ = 0;
};

// One request alone, start to finish.
Outcome run_alone(Engine& engine, const std::vector<int32_t>& prompt, const std::string& adapter,
                  const SamplingParams& sampling);

SamplingParams greedy(int max_tokens);
std::vector<int32_t> test_prompt(int length, int salt);

// Waits until the engine is idle and checks that no KV page or adapter slot is still held.
void expect_no_leaks(Engine& engine);

}  // namespace moelora::testing
