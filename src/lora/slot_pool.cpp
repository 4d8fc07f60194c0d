#include "lora/slot_pool.h"

#include "core/check.h"
#include "model/archs.h"

namespace moelora {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

LoraSlotPool::LoraSlotPool(const ModelConfig& cfg, Backend& backend, int num_slots)
    : cfg_(cfg), backend_(backend), slots_(num_slots) {
  dense_.resize(cfg.num_layers);
  experts_.resize(cfg.num_layers);
  tables_.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    dense_[l].resize(kNumLoraTargets);
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      auto [in, out] = lora_target_shape(cfg, l, target);
      if (in == 0) continue;  // this layer has no such projection
      dense_[l][t] = std::make_unique<LoraModuleTable>(backend.alloc_lora_table(num_slots, in, out));
      tables_[l].dense[t] = dense_[l][t].get();
    }
    if (cfg.layer_is_moe[l]) {
      experts_[l] = std::make_unique<MoeLoraTable>(
          backend.alloc_moe_lora_table(num_slots, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size));
      tables_[l].experts = experts_[l].get();
    }
  }
}

LoraSlotPool::~LoraSlotPool() {
  shutdown();
  // Placements (and the device copies they own) go with slots_, on this thread.
}

void LoraSlotPool::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    for (auto& j : queue_) j->cancel = true;
  }
  for (Slot& s : slots_)
    if (s.job) s.job->cancel = true;  // the one in flight stops at its next factor
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

int LoraSlotPool::find(const LoraAdapter* adapter) const {
  for (int s = 0; s < num_slots(); ++s)
    if (slots_[s].adapter.get() == adapter) return s;
  return -1;
}

LoraSlotPool::State LoraSlotPool::state(const LoraAdapter* adapter) const {
  const int s = find(adapter);
  return s < 0 ? State::kAbsent : slots_[s].state;
}

int LoraSlotPool::slot_of(const LoraAdapter* adapter) const {
  const int s = find(adapter);
  return s >= 0 && slots_[s].state == State::kResident ? s : -1;
}

int LoraSlotPool::pick_slot(bool may_evict) const {
  // An empty slot, else (may_evict) the least recently used resident one that nothing references.
  // Loading slots are never taken: their placement is in flight.
  int best = -1;
  for (int s = 0; s < num_slots(); ++s) {
    const Slot& x = slots_[s];
    if (x.state == State::kAbsent) return s;
    if (may_evict && x.state == State::kResident && x.refs == 0 &&
        (best < 0 || x.last_use < slots_[best].last_use))
      best = s;
  }
  return best;
}

bool LoraSlotPool::can_start_placement(bool may_evict) const { return pick_slot(may_evict) >= 0; }

void LoraSlotPool::clear(int slot) {
  Slot& s = slots_[slot];
  MOELORA_CHECK(s.refs == 0 && !s.job);
  // Planning stops seeing the slot at once. Its device entries keep pointing at the old copies
  // until the next placement rewrites them all, but no token carries the slot meanwhile, so no
  // kernel reads them (ops/backend.h, LoraPlacement).
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (auto& t : dense_[l])
      if (t) t->host_rank[slot] = 0;
    if (experts_[l]) experts_[l]->host_gu_rank[slot] = experts_[l]->host_d_rank[slot] = 0;
  }
  s.placement.reset();  // frees the copies (CUDA: after the work already queued on the device)
  s.adapter.reset();
  s.state = State::kAbsent;
}

size_t LoraSlotPool::placement_bytes(const LoraAdapter& a) const {
  const DType dt = backend_.lora_dtype();
  size_t total = 0;
  auto add = [&](const Tensor& t) {
    if (t.defined()) total += backend_.upload_bytes(dt, t.numel());
  };
  for (size_t l = 0; l < a.dense.size(); ++l) {
    for (const LoraFactor& f : a.dense[l])
      if (f.rank > 0) add(f.a), add(f.b);
    const ExpertLora& x = a.experts[l];
    if (x.gu_rank > 0) add(x.gu_a), add(x.gu_b);
    if (x.d_rank > 0) add(x.d_a), add(x.d_b);
  }
  return total;
}

Status LoraSlotPool::start_placement(const std::shared_ptr<const LoraAdapter>& adapter, bool may_evict) {
  MOELORA_CHECK_MSG(find(adapter.get()) < 0, "adapter '{}' already has a slot", adapter->name);
  const int slot = pick_slot(may_evict);
  if (slot < 0) return make_error(ErrorCode::kResourceExhausted, "all {} adapter slots are in use", num_slots());
  if (slots_[slot].state == State::kResident) clear(slot);
  Slot& s = slots_[slot];
  auto job = std::make_shared<Job>();
  job->slot = slot;
  job->adapter = adapter;
  job->bytes = placement_bytes(*adapter);
  job->started = std::chrono::steady_clock::now();
  s.adapter = adapter;
  s.state = State::kLoading;
  s.last_use = ++clock_;
  s.placement = backend_.begin_lora_placement(slot, job->bytes);
  job->placement = s.placement.get();
  s.job = job;
  {
    std::lock_guard<std::mutex> lk(mu_);
    MOELORA_CHECK_MSG(!stop_, "placing an adapter after the slot pool shut down");
    queue_.push_back(std::move(job));
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  }
  work_cv_.notify_one();
  return {};
}

std::vector<LoraSlotPool::PlacementReport> LoraSlotPool::poll() {
  std::vector<PlacementReport> out;
  // Cleared before looking, so a placement finishing during the scan sets it again.
  done_pending_ = false;
  for (int slot = 0; slot < num_slots(); ++slot) {
    Slot& s = slots_[slot];
    if (s.state != State::kLoading) continue;
    Job& j = *s.job;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!j.done) continue;
    }
    // The worker let go of the job: the slot's state is this thread's alone again.
    Status st = j.cancel ? make_error(ErrorCode::kCancelled, "adapter '{}' was unloaded while it loaded",
                                      j.adapter->name)
                         : j.status;
    if (st.ok() && !s.placement->ready()) {
      done_pending_ = true;  // the device is still copying: look again next time
      continue;
    }
    PlacementReport r{j.adapter, slot, st, j.bytes, j.copy_seconds, seconds_since(j.started)};
    s.job.reset();
    if (st.ok()) {
      s.placement->commit();
      s.state = State::kResident;
      s.last_use = ++clock_;  // the requests waiting for it must find it still here
    } else {
      clear(slot);
    }
    out.push_back(std::move(r));
  }
  return out;
}

Result<int> LoraSlotPool::acquire(const std::shared_ptr<const LoraAdapter>& adapter) {
  for (;;) {
    const int slot = find(adapter.get());
    if (slot < 0) {
      MOELORA_RETURN_IF_ERROR(start_placement(adapter, /*may_evict=*/true));
      continue;
    }
    if (slots_[slot].state == State::kResident) {
      slots_[slot].refs++;
      slots_[slot].last_use = ++clock_;
      return slot;
    }
    {
      std::shared_ptr<Job> job = slots_[slot].job;
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return job->done; });
    }
    // A cancelled placement (evicted meanwhile) is simply started again.
    for (PlacementReport& r : poll())
      if (r.adapter == adapter && !r.status.ok() && r.status.code() != ErrorCode::kCancelled) return r.status;
  }
}

void LoraSlotPool::release(int slot) {
  MOELORA_CHECK(slot >= 0 && slot < num_slots() && slots_[slot].refs > 0);
  slots_[slot].refs--;
}

void LoraSlotPool::evict(const LoraAdapter* adapter) {
  const int slot = find(adapter);
  if (slot < 0) return;
  Slot& s = slots_[slot];
  if (s.state == State::kLoading) {
    // The worker may be copying it right now: it stops at its next factor, and the poll() that
    // sees it done frees the slot. Nothing waits here, so an unload never stalls the engine.
    s.job->cancel = true;
    return;
  }
  MOELORA_CHECK_MSG(s.refs == 0, "evicting adapter '{}' while requests use it", adapter->name);
  clear(slot);
}

int LoraSlotPool::used_slots() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.refs > 0;
  return n;
}

int LoraSlotPool::resident_slots() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.state == State::kResident;
  return n;
}

int LoraSlotPool::loading_slots() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.state == State::kLoading;
  return n;
}

void LoraSlotPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;  // queued jobs stay undone; their placements never ran and are destroyed
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto t0 = std::chrono::steady_clock::now();
    Status st = job->cancel ? Status(ErrorCode::kCancelled, "cancelled") : run(*job);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job->status = std::move(st);
      job->copy_seconds = seconds_since(t0);
      job->done = true;
      done_pending_ = true;
    }
    done_cv_.notify_all();
    if (on_done_) on_done_();
  }
}

// On the worker. Reads only the adapter (immutable) and the table objects' device tensors (fixed
// since construction); every write goes through the placement.
Status LoraSlotPool::run(Job& job) {
  LoraPlacement& p = *job.placement;
  const LoraAdapter& a = *job.adapter;
  if (static_cast<int>(a.dense.size()) != cfg_.num_layers || static_cast<int>(a.experts.size()) != cfg_.num_layers)
    return make_error(ErrorCode::kInternal, "adapter '{}' has {} layers, the model {}", a.name, a.dense.size(),
                      cfg_.num_layers);
  const Status cancelled(ErrorCode::kCancelled, "cancelled");
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (job.cancel) return cancelled;
      const LoraFactor& f = a.dense[l][t];
      LoraModuleTable* table = dense_[l][t].get();
      if (!table) {
        if (f.rank == 0) continue;
        return make_error(ErrorCode::kInternal, "adapter '{}' targets {} of layer {}, which the model lacks", a.name,
                          lora_target_name(static_cast<LoraTarget>(t)), l);
      }
      if (f.rank == 0) {
        p.set_lora(*table, Tensor(), Tensor(), 0);
        continue;
      }
      MOELORA_ASSIGN_OR_RETURN(Tensor da, p.upload(f.a));
      MOELORA_ASSIGN_OR_RETURN(Tensor db, p.upload(f.b));
      p.set_lora(*table, da, db, f.rank);
    }
    MoeLoraTable* experts = experts_[l].get();
    const ExpertLora& x = a.experts[l];
    if (!experts) {
      if (!x.any()) continue;
      return make_error(ErrorCode::kInternal, "adapter '{}' has expert LoRA on layer {}, which has no experts", a.name,
                        l);
    }
    if (job.cancel) return cancelled;
    Backend::MoeLoraSlot ms;
    const int64_t H = cfg_.hidden_size, I = cfg_.moe_intermediate_size;
    if (x.gu_rank > 0) {
      MOELORA_ASSIGN_OR_RETURN(ms.gu_a, p.upload(x.gu_a));
      MOELORA_ASSIGN_OR_RETURN(ms.gu_b, p.upload(x.gu_b));
      ms.gu_rank = x.gu_rank;
      ms.gu_a_stride = x.gu_a.dim(0) == 1 ? 0 : x.gu_rank * H;
      ms.gu_b_stride = 2 * I * x.gu_rank;
    }
    if (x.d_rank > 0) {
      MOELORA_ASSIGN_OR_RETURN(ms.d_a, p.upload(x.d_a));
      MOELORA_ASSIGN_OR_RETURN(ms.d_b, p.upload(x.d_b));
      ms.d_rank = x.d_rank;
      ms.d_a_stride = x.d_rank * I;
      ms.d_b_stride = x.d_b.dim(0) == 1 ? 0 : H * x.d_rank;
    }
    p.set_moe_lora(*experts, ms);
  }
  return p.finish();
}

}  // namespace moelora
