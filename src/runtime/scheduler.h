// Continuous batching. Each step takes every running decode (one token each), continues prefills
// in chunks, and admits waiting requests while the token budget, KV pages and adapter slots
// allow. Adapter slots are scheduled like pages: a request whose adapter cannot get a slot waits
// while others (base requests, resident adapters) go ahead. A request whose adapter is not in a
// slot starts its placement, which runs off the engine thread (lora/slot_pool.h), and is admitted
// by the first step after the placement completed; the steps in between run everything else.
// When pages run out the youngest running request is preempted (its pages go to the prefix cache)
// and recomputed later.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "lora/adapter_registry.h"
#include "lora/slot_pool.h"
#include "ops/types.h"
#include "runtime/engine.h"
#include "runtime/kv_cache_manager.h"
#include "runtime/sampler.h"

namespace moelora {

struct Sequence {
  GenerationRequest req;
  OutputCallback on_output;
  std::vector<int32_t> tokens;  // prompt + generated
  int prompt_len = 0;
  int num_computed = 0;         // tokens whose KV is in the cache
  std::vector<int> pages;
  std::shared_ptr<const LoraAdapter> adapter;  // null = base model
  uint64_t adapter_id = 0;      // registry generation (0 = base): part of prefix-cache keys
  int slot = -1;
  uint64_t seed = 0;             // sampling seed: the request's, or drawn at submission
  PenaltyCounts penalties;       // token counts for the penalties, synced before each sample
  PenaltySlotLease penalty_slot; // or the backend's penalty slot that counts `tokens` (slot() >= 0)
  uint64_t arrival = 0;
  int cached_tokens = 0;
  bool first_token_sent = false;
  std::chrono::steady_clock::time_point submitted;
  int generated() const { return static_cast<int>(tokens.size()) - prompt_len; }
};

struct ScheduledStep {
  StepBatch batch;
  std::vector<Sequence*> seqs;     // scheduled this step, in batch order
  std::vector<int> new_tokens;     // tokens of each seq in the batch
  std::vector<Sequence*> samplers; // seqs that sample after this step, in logit_rows order
};

class Scheduler {
 public:
  Scheduler(const EngineOptions& opts, KvCacheManager& kv, LoraSlotPool& slots, AdapterRegistry& registry);

  void add(std::unique_ptr<Sequence> seq);
  // Plans the next step (empty batch when there is nothing to run). Sequences whose adapter
  // cannot be read any more are returned in `failed` with the error.
  ScheduledStep schedule(std::vector<std::pair<std::unique_ptr<Sequence>, Status>>* failed);
  // Records that the step ran: advances num_computed of every scheduled sequence.
  void step_done(const ScheduledStep& step);
  // Removes a running or waiting sequence, freeing its pages and slot.
  std::unique_ptr<Sequence> remove(const std::string& id);
  // A placement of `adapter` failed: the waiting sequences that wait for it are returned in
  // `failed` with `why` (running ones hold other, resident adapters and are untouched).
  void fail_waiting(const LoraAdapter* adapter, const Status& why,
                    std::vector<std::pair<std::unique_ptr<Sequence>, Status>>* failed);

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }
  const std::deque<std::unique_ptr<Sequence>>& waiting() const { return waiting_; }
  uint64_t preemptions() const { return preemptions_; }
  uint64_t prefix_queries() const { return prefix_queries_; }
  uint64_t prefix_hits() const { return prefix_hits_; }

 private:
  bool ensure_pages(Sequence& s, int upto_tokens);
  void release_resources(Sequence& s);
  void preempt_youngest(const Sequence* keep);
  Status resolve_adapter(Sequence& s);  // the adapter's weights and prefix namespace, once

  EngineOptions opts_;
  KvCacheManager& kv_;
  LoraSlotPool& slots_;
  AdapterRegistry& registry_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  uint64_t preemptions_ = 0, prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace moelora
