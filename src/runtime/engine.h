// The engine: requests in, tokens out. One engine thread owns the model and the backend; any
// thread may submit, cancel, load or unload adapters, and read stats. This is the only API the
// server uses: the server never touches tensors and the runtime never sees JSON.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"

namespace moelora {

class Backend;
class Model;
struct LoraAdapter;

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::optional<uint64_t> seed;  // per-request RNG seed; unseeded requests draw one at admission
  int max_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool ignore_eos = false;
  int logprobs = 0;          // how many top alternatives to report per token (0 = none)
  // Logit processors (vLLM's semantics; runtime/sampler.h states the order and the math).
  float presence_penalty = 0.0f;    // [-2, 2]: subtracted once from tokens already generated
  float frequency_penalty = 0.0f;   // [-2, 2]: subtracted per occurrence in the generated tokens
  float repetition_penalty = 1.0f;  // (0, 2]: tokens of prompt or output: logit / p if > 0, else * p
  int min_tokens = 0;               // EOS and stop ids are banned until this many were generated
  std::vector<std::pair<int32_t, float>> logit_bias;  // token -> bias added to its logit, [-100, 100]
  std::vector<int32_t> allowed_token_ids;             // non-empty: every other token is banned
  std::vector<std::vector<int32_t>> bad_words;        // token sequences that are never completed
};

struct GenerationRequest {
  std::string id;                // unique among live requests
  std::vector<int32_t> prompt;
  std::string adapter;           // "" = base model
  SamplingParams sampling;
  // vLLM's cache_salt: prefix-cache entries are shared only between requests with the same salt
  // (and adapter), so one tenant cannot learn from cached_tokens what another one sent.
  std::string cache_salt;
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason r);

struct TokenEvent {
  int32_t token = 0;
  float logprob = 0.0f;  // of the chosen token under the (unmodified) model distribution
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

// Delivered on the engine thread: callbacks must be quick and must not call back into the engine
// except cancel().
struct RequestOutput {
  std::vector<TokenEvent> tokens;  // new tokens since the last delivery
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  Status error;                    // set when reason == kError
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;           // prompt tokens served from the prefix cache
  double first_token_latency_s = 0;  // set with the first token
};
using OutputCallback = std::function<void(const RequestOutput&)>;

struct EngineOptions {
  int max_num_seqs = 64;          // running sequences at most
  int max_batch_tokens = 2048;    // tokens per step (chunked prefill splits longer prompts)
  int kv_page_size = 16;
  int kv_num_pages = 0;           // > 0: exactly this many KV pages
  // Backends with device memory (CUDA): the KV cache gets what is left of this fraction of the
  // device after weights, the step scratch (sized by a warm-up step) and adapter slots
  // (runtime/memory_plan.h). Others: enough for max_num_seqs full-length sequences within
  // kv_cache_bytes.
  double gpu_memory_utilization = 0.90;
  size_t kv_cache_bytes = 4ull << 30;
  int max_model_len = 0;          // 0 = the model's max_position_embeddings
  int max_loras_per_batch = 8;    // adapter slots on the backend
  int max_loaded_loras = 32;      // adapters kept on the host (LRU beyond that)
  int max_lora_rank = 256;
  int max_waiting = 1024;         // queue bound: submit() answers ResourceExhausted past it
  bool enable_prefix_cache = true;
  // Sequences whose penalties' counts the backend keeps (ops/sampling.h penalty slots: 4 bytes per
  // vocabulary token each, 0.6 MiB at a 152k vocabulary); -1: min(max_num_seqs, 256). A penalised
  // request beyond them, or on a backend without slots, sends its counts as edits every step (same
  // tokens, more host work).
  int penalty_slots = -1;
  std::string lora_root;          // when set, adapter paths must resolve inside it
};

struct AdapterInfo {
  std::string name;
  std::string path;
  bool pinned = false;
  bool resident = false;  // in a backend slot now
  bool on_host = false;   // weights in host memory (else re-read from `path` on next use)
  int max_rank = 0;
  uint64_t generation = 0;  // bumps on every (re)load: prefix-cache keys use it
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  int kv_pages_total = 0;
  int kv_pages_used = 0;
  int kv_pages_cached = 0;        // held only by the prefix cache (reclaimable)
  int lora_slots_total = 0;
  int lora_slots_used = 0;
  int lora_slots_loading = 0;     // slots whose adapter is being copied in (off the engine thread)
  int penalty_slots_total = 0;    // backend penalty slots (EngineOptions::penalty_slots)
  int penalty_slots_used = 0;     // held by running penalised requests (0 when idle: no leak)
  std::vector<std::string> running_adapters;
  std::vector<std::string> waiting_adapters;
  uint64_t prompt_tokens_total = 0;
  uint64_t generation_tokens_total = 0;
  uint64_t num_preemptions_total = 0;
  uint64_t prefix_cache_queries_total = 0;  // prompt tokens looked up
  uint64_t prefix_cache_hits_total = 0;     // prompt tokens found
  uint64_t requests_finished_total = 0;
  uint64_t steps_total = 0;
  double step_seconds_total = 0;       // wall time of steps (schedule -> sampled tokens)
  double step_host_seconds_total = 0;  // of which the engine thread was not waiting for the device
  // Adapter placements (copies into a slot, on the slot pool's worker thread).
  uint64_t lora_loads_total = 0;          // completed
  uint64_t lora_load_failures_total = 0;  // failed (their waiting requests failed with the error)
  double lora_load_seconds_total = 0;     // worker time of completed placements
  uint64_t lora_load_bytes_total = 0;     // device bytes they copied
};

struct AdapterLoadSpec {
  bool pinned = false;   // never dropped from host memory
  bool replace = false;  // load_inplace: the new version replaces a loaded one atomically once it
                         // validated (a failed load leaves the old one serving)
  std::string root;      // every file must resolve inside it, at load and every re-read ("" = anywhere)
};

class Engine {
 public:
  // Builds an engine over a model loaded on `backend` and starts its thread.
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<Backend> backend, std::unique_ptr<Model> model,
                                                const EngineOptions& opts);
  ~Engine();

  const Model& model() const;
  const EngineOptions& options() const;
  int max_model_len() const;

  // Validates and queues a request. Errors: NotFound (unknown adapter), InvalidArgument (empty or
  // too long prompt, bad sampling values), ResourceExhausted (queue full), AlreadyExists (id).
  Status submit(GenerationRequest req, OutputCallback on_output);
  // Finishes a request with FinishReason::kCancelled and frees its KV pages and slot. Unknown or
  // finished ids are ignored.
  void cancel(const std::string& request_id);

  // Adapters (any thread). load: host-side load + validation; errors leave everything unchanged.
  // Files are read and validated without the engine's lock (steps keep running); the result is
  // swapped in between steps. This overload confines files to EngineOptions::lora_root.
  Status load_adapter(const std::string& name, const std::string& path, bool pinned = false);
  Status load_adapter(const std::string& name, const std::string& path, const AdapterLoadSpec& spec);
  // An adapter made in memory (benchmarks: lora/random_adapter.h), pinned: it has no files.
  Status add_adapter(const std::string& name, std::shared_ptr<const LoraAdapter> adapter);
  // Refuses (FailedPrecondition) while requests use the adapter unless `wait` is set, in which
  // case new requests are refused and the call returns once the running ones finish.
  Status unload_adapter(const std::string& name, bool wait = false);
  std::vector<AdapterInfo> adapters() const;
  bool has_adapter(const std::string& name) const;

  EngineStats stats() const;

  // Runs the engine thread (create() starts it); stop() finishes every request as cancelled.
  void stop();

  // Runs `fn` on the engine thread between steps and waits for it (tests, verify).
  void run_on_engine_thread(const std::function<void()>& fn);

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelora
