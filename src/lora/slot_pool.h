// Adapter slots on the backend: the LoRA equivalent of KV pages. An adapter in use by a running
// request holds a slot (reference counted); unreferenced resident adapters stay until their slot
// is needed (LRU). Placing an adapter fills the per-(layer, projection) pointer tables that kernels
// read; every table entry of a slot is rewritten on each placement, so a slot never serves a
// previous adapter's weights (targets the new adapter lacks get rank 0).
//
// Placing runs off the engine thread. A full-size adapter is GiBs (Qwen3-30B-A3B, rank 16 on every
// expert: 1.3 GB), and copying it on the engine thread stalled every running request for seconds.
// start_placement() reserves a slot (state loading) and queues the copy on the pool's placement
// worker; poll(), called by the engine thread before every step, commits the placements whose
// copies completed (a readiness check, never a wait) and frees the slots of failed or cancelled
// ones. One worker thread: placements are bound by the host-to-device link, so more threads would
// not finish them sooner. acquire() is the blocking form for callers without a scheduler (verify,
// tests).
//
// Threads: every method is called by the thread that runs steps (the engine thread), between
// steps, except placements_done() (any thread). The worker touches only its job: the adapter
// (immutable), the job's LoraPlacement (ops/backend.h says what it may do while steps run) and
// the tables through it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/status.h"
#include "lora/adapter.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

class LoraSlotPool {
 public:
  enum class State { kAbsent, kLoading, kResident };

  // What poll() reports of each placement that ended.
  struct PlacementReport {
    std::shared_ptr<const LoraAdapter> adapter;
    int slot = -1;
    Status status;              // kCancelled: evicted while loading; other errors: the placement failed
    size_t bytes = 0;           // device bytes of its factors
    double copy_seconds = 0;    // the worker's time on it (conversion, copies, table entries)
    double total_seconds = 0;   // from start_placement to the poll that ended it (queueing included)
  };

  LoraSlotPool(const ModelConfig& cfg, Backend& backend, int num_slots);
  ~LoraSlotPool();  // shutdown()
  LoraSlotPool(const LoraSlotPool&) = delete;
  LoraSlotPool& operator=(const LoraSlotPool&) = delete;

  int num_slots() const { return static_cast<int>(slots_.size()); }
  State state(const LoraAdapter* adapter) const;

  // ---- Asynchronous placement (the scheduler).
  // Reserves a slot for `adapter` (which must be absent) and queues its placement. The slot is an
  // empty one or, with `may_evict`, the least recently used unreferenced resident adapter's.
  // ResourceExhausted when there is none.
  Status start_placement(const std::shared_ptr<const LoraAdapter>& adapter, bool may_evict = true);
  bool can_start_placement(bool may_evict) const;
  // Ends the placements that are done: committed (resident) when their device work completed,
  // slot freed when they failed or were cancelled. One report per placement ended.
  std::vector<PlacementReport> poll();
  // True once a placement finished on the worker and poll() has not looked yet (any thread).
  bool placements_done() const { return done_pending_.load(); }
  // Called by the worker (without the pool's lock held) each time a placement finishes, so the
  // engine thread can sleep until then. Set before the first placement.
  void set_on_placement_done(std::function<void()> fn) { on_done_ = std::move(fn); }
  // Cancels what is queued or in flight and joins the worker: after it, the worker calls nothing.
  void shutdown();

  // ---- Slots of resident adapters.
  // Slot of `adapter` with one more reference. Resident: at once. Otherwise it is placed (see
  // start_placement) and this call blocks until the placement ends, returning its error if it
  // failed. ResourceExhausted when every slot is referenced by other adapters.
  Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter);
  void release(int slot);
  // Unload. A resident adapter (which no request may reference) leaves its slot now; a loading one
  // is cancelled and its slot is freed by the poll() that sees the worker let go of it.
  void evict(const LoraAdapter* adapter);
  int slot_of(const LoraAdapter* adapter) const;  // resident only; -1 otherwise
  int used_slots() const;                          // slots with references
  int resident_slots() const;
  int loading_slots() const;
  const LoraTables& tables() const { return tables_; }

 private:
  // One placement, shared by the engine thread and the worker.
  struct Job {
    int slot = -1;
    std::shared_ptr<const LoraAdapter> adapter;
    LoraPlacement* placement = nullptr;  // owned by the slot; used by the worker until `done`
    size_t bytes = 0;
    std::chrono::steady_clock::time_point started;
    std::atomic<bool> cancel{false};
    // Written by the worker under mu_.
    bool done = false;
    Status status;
    double copy_seconds = 0;
  };
  struct Slot {
    std::shared_ptr<const LoraAdapter> adapter;  // null = empty
    State state = State::kAbsent;
    int refs = 0;
    uint64_t last_use = 0;
    std::unique_ptr<LoraPlacement> placement;  // the slot's device copies (resident) or in flight
    std::shared_ptr<Job> job;                  // while loading
  };
  int find(const LoraAdapter* adapter) const;  // loading or resident
  int pick_slot(bool may_evict) const;
  void clear(int slot);
  size_t placement_bytes(const LoraAdapter& a) const;
  Status run(Job& job);  // on the worker
  void worker_loop();

  const ModelConfig& cfg_;
  Backend& backend_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  // Owned tables; tables_ holds pointers into them.
  std::vector<std::vector<std::unique_ptr<LoraModuleTable>>> dense_;  // [layer][target]
  std::vector<std::unique_ptr<MoeLoraTable>> experts_;                // [layer]
  LoraTables tables_;

  // The worker and its queue.
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::thread worker_;
  std::atomic<bool> done_pending_{false};
  std::function<void()> on_done_;
};

}  // namespace moelora
