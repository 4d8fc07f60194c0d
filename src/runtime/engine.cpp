#include "runtime/engine.h"

#include <cmath>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "core/log.h"
#include "lora/adapter_registry.h"
#include "lora/slot_pool.h"
#include "model/model.h"
#include "runtime/kv_cache_manager.h"
#include "runtime/memory_plan.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"

namespace moelora {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "?";
}

namespace {

// The largest step the scheduler can form: max_batch_tokens prefill tokens spread over as many
// sequences as may sample at once, every one asking for logits. Run once eagerly at start-up so
// the backend's scratch and sampling buffers reach the size serving will need.
size_t warm_up_largest_step(Model& model, Backend& backend, const EngineOptions& o) {
  const ModelConfig& c = model.config();
  const int T = o.max_batch_tokens, S = std::max(1, std::min(o.max_num_seqs, T));
  const int per_seq = (T + S - 1) / S, pages_per_seq = (per_seq + o.kv_page_size - 1) / o.kv_page_size;
  std::vector<KvLayer> kv = model.alloc_kv_cache(S * pages_per_seq, o.kv_page_size);
  StepBatch b;
  for (int s = 0, t = 0; s < S && t < T; ++s) {
    std::vector<int32_t> pages;
    for (int p = 0; p < pages_per_seq; ++p) pages.push_back(s * pages_per_seq + p);
    b.seq_pages.push_back(pages);
    for (int i = 0; i < per_seq && t < T; ++i, ++t) {
      b.token_ids.push_back(t % c.vocab_size);
      b.positions.push_back(i);
      b.token_seq.push_back(s);
      b.token_slot.push_back(-1);
    }
    b.logit_rows.push_back(b.num_tokens() - 1);
  }
  backend.reserve_sampling(static_cast<int>(b.logit_rows.size()), c.vocab_size);
  Tensor logits = model.forward_logits(b, kv, nullptr);
  std::vector<SampleRow> rows(b.logit_rows.size());
  (void)backend.sample(logits, rows);
  const size_t peak = backend.scratch_peak_bytes();
  // Room above the measured peak for what the warm-up did not exercise (LoRA plans and
  // shrink/expand scratch of adapter tokens: small next to the activations).
  backend.fit_scratch(peak + peak / 4 + (64u << 20));
  return peak;
}

// KV pages: from the device's memory where the backend has one, else as many as max_num_seqs
// full-length sequences need within kv_cache_bytes.
Result<int> size_kv_cache(Model& model, Backend& backend, const EngineOptions& o, int max_len) {
  const ModelConfig& c = model.config();
  const int per_seq = (max_len + o.kv_page_size - 1) / o.kv_page_size;
  const size_t page_bytes = kv_page_bytes(c, model.kv_shape(), o.kv_page_size, dtype_size(backend.act_dtype()));
  size_t free = 0, total = 0;
  if (!backend.device_memory(&free, &total)) {
    if (o.kv_num_pages > 0) return o.kv_num_pages;
    const size_t wanted = static_cast<size_t>(per_seq) * o.max_num_seqs;
    const size_t cap = std::max<size_t>(per_seq, o.kv_cache_bytes / page_bytes);
    return static_cast<int>(std::min(wanted, cap));
  }
  const size_t scratch = warm_up_largest_step(model, backend, o);
  if (!backend.device_memory(&free, &total)) return make_error(ErrorCode::kInternal, "device memory unreadable");
  MemoryInputs in;
  in.device_total = total;
  in.device_free = free;
  in.utilization = o.gpu_memory_utilization;
  in.adapter_reserve = static_cast<size_t>(o.max_loras_per_batch) * adapter_slot_bytes(c, o.max_lora_rank);
  in.page_bytes = page_bytes;
  in.pages_per_sequence = per_seq;
  in.kv_pages_override = o.kv_num_pages;
  in.scratch_bytes = scratch;
  MOELORA_ASSIGN_OR_RETURN(MemoryPlan plan, plan_memory(in));
  MOELORA_LOG_INFO("{}; KV holds {} tokens", plan.summary, static_cast<int64_t>(plan.kv_pages) * o.kv_page_size);
  return plan.kv_pages;
}

}  // namespace

struct Engine::Impl {
  EngineOptions opts;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  int max_len = 0;
  std::vector<KvLayer> kv;
  std::unique_ptr<KvCacheManager> pages;
  std::unique_ptr<LoraSlotPool> slots;
  std::unique_ptr<AdapterRegistry> registry;
  std::unique_ptr<Scheduler> scheduler;
  // Free penalty slots of the backend (engine thread only; sequences give theirs back on exit).
  std::shared_ptr<PenaltySlotPool> penalty_slots = std::make_shared<PenaltySlotPool>();

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Sequence>> incoming;
  std::vector<std::string> cancels;
  std::deque<std::function<void()>> tasks;
  std::set<std::string> live_ids;
  std::set<std::string> draining;  // adapters being unloaded: no new requests
  bool stopping = false;
  std::thread thread;
  uint64_t arrivals = 0;
  std::mt19937_64 seed_source{std::random_device{}()};
  EngineStats counters;

  struct Delivery {
    OutputCallback cb;
    RequestOutput out;
  };

  RequestOutput finished_output(const Sequence& s, FinishReason reason, Status error = {}) {
    RequestOutput o;
    o.finished = true;
    o.reason = reason;
    o.error = std::move(error);
    o.prompt_tokens = s.prompt_len;
    o.completion_tokens = s.generated();
    o.cached_tokens = s.cached_tokens;
    return o;
  }

  void finish(std::unique_ptr<Sequence> s, FinishReason reason, Status error, std::vector<Delivery>* out) {
    if (!s->req.adapter.empty()) registry->add_user(s->req.adapter, -1);
    live_ids.erase(s->req.id);
    counters.requests_finished_total++;
    out->push_back({s->on_output, finished_output(*s, reason, std::move(error))});
  }

  bool is_stop_token(const Sequence& s, int32_t tok) const {
    if (!s.req.sampling.ignore_eos)
      for (int e : model->config().eos_token_ids)
        if (tok == e) return true;
    for (int32_t t : s.req.sampling.stop_token_ids)
      if (tok == t) return true;
    return false;
  }

  // A placement ended (poll, engine thread): metrics, a log line, and on failure the requests
  // that wait for that adapter fail with the error. Nothing else is affected.
  void placement_ended(LoraSlotPool::PlacementReport& r,
                       std::vector<std::pair<std::unique_ptr<Sequence>, Status>>* failed) {
    const double gib = static_cast<double>(r.bytes) / (1ull << 30);
    if (r.status.ok()) {
      counters.lora_loads_total++;
      counters.lora_load_seconds_total += r.copy_seconds;
      counters.lora_load_bytes_total += r.bytes;
      MOELORA_LOG_INFO("lora: adapter '{}' placed in slot {}: {:.3g} GiB in {:.1f} ms ({:.2f} GiB/s), ready {:.1f} ms "
                       "after it was asked for",
                       r.adapter->name, r.slot, gib, r.copy_seconds * 1e3,
                       r.copy_seconds > 0 ? gib / r.copy_seconds : 0.0, r.total_seconds * 1e3);
    } else if (r.status.code() == ErrorCode::kCancelled) {
      MOELORA_LOG_INFO("lora: placing adapter '{}' in slot {} was cancelled (unloaded while loading)", r.adapter->name,
                       r.slot);
    } else {
      counters.lora_load_failures_total++;
      MOELORA_LOG_WARN("lora: placing adapter '{}' ({:.3g} GiB) in slot {} failed after {:.1f} ms: {}",
                       r.adapter->name, gib, r.slot, r.copy_seconds * 1e3, r.status.message());
      scheduler->fail_waiting(r.adapter.get(),
                              Status(r.status.code(), fmt::format("adapter '{}' could not be placed in an adapter "
                                                                  "slot: {}", r.adapter->name, r.status.message())),
                              failed);
    }
  }

  void loop() {
    // The last schedule() ran nothing: the waiting requests wait for placements (or pages), so
    // the thread sleeps until something changes instead of scheduling empty steps. The slot pool
    // wakes it when a placement finishes; the timeout only bounds a wake-up that nothing sends.
    bool blocked = false;
    for (;;) {
      std::vector<Delivery> deliveries;
      ScheduledStep step;
      std::chrono::steady_clock::time_point t_begin;
      {
        std::unique_lock<std::mutex> lk(mu);
        auto woken = [&] {
          return stopping || !incoming.empty() || !cancels.empty() || !tasks.empty() || scheduler->num_running() > 0 ||
                 (scheduler->num_waiting() > 0 && !blocked) || slots->placements_done();
        };
        if (blocked) cv.wait_for(lk, std::chrono::milliseconds(50), woken);
        else cv.wait(lk, woken);
        if (stopping) break;
        t_begin = std::chrono::steady_clock::now();
        while (!tasks.empty()) {
          auto t = std::move(tasks.front());
          tasks.pop_front();
          t();
        }
        for (const std::string& id : cancels) {
          if (auto s = scheduler->remove(id)) finish(std::move(s), FinishReason::kCancelled, {}, &deliveries);
          for (auto it = incoming.begin(); it != incoming.end(); ++it)
            if ((*it)->req.id == id) {
              finish(std::move(*it), FinishReason::kCancelled, {}, &deliveries);
              incoming.erase(it);
              break;
            }
        }
        cancels.clear();
        while (!incoming.empty()) {
          scheduler->add(std::move(incoming.front()));
          incoming.pop_front();
        }
        std::vector<std::pair<std::unique_ptr<Sequence>, Status>> failed;
        for (LoraSlotPool::PlacementReport& r : slots->poll()) placement_ended(r, &failed);
        step = scheduler->schedule(&failed);
        blocked = step.batch.num_tokens() == 0 && failed.empty() && scheduler->num_waiting() > 0;
        for (auto& [s, st] : failed) finish(std::move(s), FinishReason::kError, st, &deliveries);
      }
      if (step.batch.num_tokens() > 0) {
        // The forward pass and sampling run without the lock: submit/cancel/stats stay
        // responsive. Only this thread changes sequences, so reading them here is safe.
        Tensor logits = model->forward_logits(step.batch, kv, &slots->tables());
        std::vector<SampleRow> rows;
        rows.reserve(step.samplers.size());
        const ModelConfig& cfg = model->config();
        for (Sequence* s : step.samplers) {
          const SamplingParams& sp = s->req.sampling;
          // A penalised sequence takes a free penalty slot at its first sample (its whole context
          // counted once, on the device); after that the sampler counts each drawn token there, so
          // the slot counts exactly s->tokens (every drawn token is appended below).
          if (s->penalty_slot.slot() < 0 && wants_penalty_counts(sp)) {
            s->penalty_slot = PenaltySlotLease::take(penalty_slots);
            if (s->penalty_slot.slot() >= 0) backend->penalty_reset(s->penalty_slot.slot(), s->tokens, s->prompt_len);
          }
          if (s->penalty_slot.slot() >= 0) {
            rows.push_back(make_slot_sample_row(sp, s->seed, s->tokens, s->prompt_len, cfg.eos_token_ids,
                                                cfg.vocab_size, s->penalty_slot.slot()));
          } else {
            s->penalties.sync(sp, s->tokens, s->prompt_len);
            rows.push_back(make_sample_row(sp, s->seed, s->tokens, s->prompt_len, cfg.eos_token_ids, cfg.vocab_size,
                                           s->penalties));
          }
        }
        std::vector<SampleOutput> sampled = backend->sample(logits, rows);
        const auto t_end = std::chrono::steady_clock::now();
        const double wall = std::chrono::duration<double>(t_end - t_begin).count();
        const double wait = backend->take_device_wait_seconds();
        std::lock_guard<std::mutex> lk(mu);
        scheduler->step_done(step);
        counters.steps_total++;
        counters.step_seconds_total += wall;
        counters.step_host_seconds_total += std::max(0.0, wall - wait);
        for (size_t r = 0; r < step.samplers.size(); ++r) {
          Sequence* s = step.samplers[r];
          SampleOutput& sr = sampled[r];
          s->tokens.push_back(sr.token);
          counters.generation_tokens_total++;
          RequestOutput o;
          o.tokens.push_back({sr.token, sr.logprob, std::move(sr.top_logprobs)});
          o.prompt_tokens = s->prompt_len;
          o.completion_tokens = s->generated();
          o.cached_tokens = s->cached_tokens;
          if (!s->first_token_sent) {
            s->first_token_sent = true;
            o.first_token_latency_s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - s->submitted).count();
          }
          FinishReason reason = FinishReason::kNone;
          if (is_stop_token(*s, sr.token)) reason = FinishReason::kStop;
          else if (s->generated() >= s->req.sampling.max_tokens || static_cast<int>(s->tokens.size()) >= max_len)
            reason = FinishReason::kLength;
          if (reason != FinishReason::kNone) {
            o.finished = true;
            o.reason = reason;
            std::unique_ptr<Sequence> done = scheduler->remove(s->req.id);
            if (!done->req.adapter.empty()) registry->add_user(done->req.adapter, -1);
            live_ids.erase(done->req.id);
            counters.requests_finished_total++;
            deliveries.push_back({done->on_output, std::move(o)});
          } else {
            deliveries.push_back({s->on_output, std::move(o)});
          }
        }
      }
      for (auto& d : deliveries) d.cb(d.out);
    }
    // Stopping: everything still queued or running ends as cancelled.
    std::vector<Delivery> deliveries;
    {
      std::lock_guard<std::mutex> lk(mu);
      while (!tasks.empty()) {
        auto t = std::move(tasks.front());
        tasks.pop_front();
        t();
      }
      std::vector<std::string> ids(live_ids.begin(), live_ids.end());
      for (const std::string& id : ids)
        if (auto s = scheduler->remove(id)) finish(std::move(s), FinishReason::kCancelled, {}, &deliveries);
      while (!incoming.empty()) {
        finish(std::move(incoming.front()), FinishReason::kCancelled, {}, &deliveries);
        incoming.pop_front();
      }
    }
    for (auto& d : deliveries) d.cb(d.out);
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() { stop(); }

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<Backend> backend, std::unique_ptr<Model> model,
                                               const EngineOptions& requested) {
  if (requested.max_num_seqs < 1 || requested.max_batch_tokens < 1 || requested.kv_page_size < 1 ||
      requested.max_loras_per_batch < 1 || requested.max_loaded_loras < requested.max_loras_per_batch)
    return invalid_argument("engine options out of range (max_loaded_loras must be >= max_loras_per_batch)");
  EngineOptions opts = requested;
  // Kernels with a rank ceiling (CUDA: 128) would abort when an adapter above it is placed in a
  // slot; lowering the engine's ceiling makes the registry refuse such an adapter when it loads.
  // The default (256) stays usable on every backend, so this lowers rather than refuses.
  if (const int cap = backend->max_lora_rank(); cap > 0 && opts.max_lora_rank > cap) {
    MOELORA_LOG_WARN("engine: the {} backend's LoRA kernels take ranks up to {}: max_lora_rank {} lowered to {} "
                     "(adapters of a higher rank are refused when they load)",
                     backend->name(), cap, opts.max_lora_rank, cap);
    opts.max_lora_rank = cap;
  }
  // The model's shapes passed the backend at load; the adapter capacity is known only now.
  ModelShapes shapes = model->shapes();
  shapes.lora_slots = opts.max_loras_per_batch;
  shapes.max_lora_rank = opts.max_lora_rank;
  MOELORA_RETURN_IF_ERROR(backend->check_model_shapes(shapes).with_context(
      fmt::format("max_loras_per_batch {}, max_lora_rank {}: ", opts.max_loras_per_batch, opts.max_lora_rank)));
  auto impl = std::make_unique<Impl>();
  impl->opts = opts;
  const ModelConfig& cfg = model->config();
  impl->max_len = opts.max_model_len > 0 ? opts.max_model_len : cfg.max_position_embeddings;
  // Penalty slots before the KV cache is sized, so their memory is not the cache's.
  const int want_penalty_slots = opts.penalty_slots >= 0 ? opts.penalty_slots : std::min(opts.max_num_seqs, 256);
  backend->reserve_penalty_slots(want_penalty_slots, cfg.vocab_size);
  for (int i = backend->penalty_slots() - 1; i >= 0; --i) impl->penalty_slots->free.push_back(i);
  if (backend->penalty_slots() > 0)
    MOELORA_LOG_INFO("engine: {} penalty slots ({:.1f} MiB): penalised requests keep their token counts on the {} backend",
                     backend->penalty_slots(), static_cast<double>(backend->penalty_slots()) * cfg.vocab_size * 4 / (1 << 20),
                     backend->name());
  MOELORA_ASSIGN_OR_RETURN(const int num_pages, size_kv_cache(*model, *backend, opts, impl->max_len));
  impl->kv = model->alloc_kv_cache(num_pages, opts.kv_page_size);
  impl->pages = std::make_unique<KvCacheManager>(num_pages, opts.kv_page_size, opts.enable_prefix_cache);
  impl->slots = std::make_unique<LoraSlotPool>(cfg, *backend, opts.max_loras_per_batch);
  {
    Impl* p = impl.get();
    // Taking the lock before notifying: the engine thread tests placements_done() under it, so the
    // wake-up cannot fall between its test and its wait.
    p->slots->set_on_placement_done([p] {
      { std::lock_guard<std::mutex> lk(p->mu); }
      p->cv.notify_one();
    });
  }
  AdapterLoadOptions load_opts;
  load_opts.max_rank = opts.max_lora_rank;
  load_opts.factor_dtype = backend->lora_dtype();  // converted on the loading thread
  impl->registry = std::make_unique<AdapterRegistry>(cfg, load_opts,
                                                     opts.max_loaded_loras, opts.lora_root);
  impl->scheduler = std::make_unique<Scheduler>(opts, *impl->pages, *impl->slots, *impl->registry);
  impl->backend = std::move(backend);
  impl->model = std::move(model);
  MOELORA_LOG_INFO("engine: {} on {}{}, {} KV pages of {} positions, {} adapter slots, max model length {}",
                   arch_name(cfg.arch), impl->backend->name(),
                   !cfg.is_mla() ? ""
                   : impl->model->mla_absorbed() ? " (MLA absorbed: latent KV cache)"
                                                 : " (MLA decompressed: per-head KV cache)",
                   num_pages, opts.kv_page_size, opts.max_loras_per_batch, impl->max_len);
  std::unique_ptr<Engine> e(new Engine(std::move(impl)));
  Impl* p = e->impl_.get();
  p->thread = std::thread([p] { p->loop(); });
  return e;
}

const Model& Engine::model() const { return *impl_->model; }
const EngineOptions& Engine::options() const { return impl_->opts; }
int Engine::max_model_len() const { return impl_->max_len; }

Status Engine::submit(GenerationRequest req, OutputCallback on_output) {
  Impl& m = *impl_;
  const int V = m.model->config().vocab_size;
  MOELORA_RETURN_IF_ERROR(validate_sampling(req.sampling, V));
  if (req.prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t t : req.prompt)
    if (t < 0 || t >= V) return invalid_argument("token id {} is outside the vocabulary (0..{})", t, V - 1);
  const int total = static_cast<int>(req.prompt.size()) + req.sampling.max_tokens;
  if (total > m.max_len)
    return invalid_argument("This model's maximum context length is {} tokens. However, you requested {} tokens ({} in "
                            "the prompt, {} in the completion). Please reduce the length of the prompt or completion.",
                            m.max_len, total, req.prompt.size(), req.sampling.max_tokens);
  const int pages_needed = (total + m.opts.kv_page_size - 1) / m.opts.kv_page_size;
  if (pages_needed > m.pages->total_pages())
    return make_error(ErrorCode::kInvalidArgument, "the request needs {} KV pages but the cache has {}", pages_needed,
                      m.pages->total_pages());
  if (!req.adapter.empty()) {
    // An adapter dropped from host memory is read back here, on the submitting thread and
    // without the lock, so the engine thread never reads files between steps.
    std::optional<AdapterRegistry::RereadTicket> ticket;
    {
      std::lock_guard<std::mutex> lk(m.mu);
      ticket = m.registry->needs_reread(req.adapter);
    }
    if (ticket) {
      auto adapter = m.registry->reread(req.adapter, *ticket);
      std::lock_guard<std::mutex> lk(m.mu);
      MOELORA_RETURN_IF_ERROR(m.registry->finish_reread(req.adapter, *ticket, std::move(adapter)));
    }
  }
  auto s = std::make_unique<Sequence>();
  s->tokens = req.prompt;
  s->prompt_len = static_cast<int>(req.prompt.size());
  s->on_output = std::move(on_output);
  s->submitted = std::chrono::steady_clock::now();
  // cache_salt: a salted base-model request keys the prefix cache under its own namespace. (An
  // adapter request's namespace is set at admission, in Scheduler::admit_adapter.)
  if (!req.cache_salt.empty()) s->adapter_id = prefix_namespace(0, req.cache_salt);
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.stopping) return make_error(ErrorCode::kFailedPrecondition, "the engine is shutting down");
    if (m.live_ids.count(req.id)) return make_error(ErrorCode::kAlreadyExists, "request id '{}' is in use", req.id);
    if (!req.adapter.empty() && (!m.registry->contains(req.adapter) || m.draining.count(req.adapter)))
      return not_found("The model `{}` does not exist.", req.adapter);
    if (static_cast<int>(m.incoming.size()) + m.scheduler->num_waiting() >= m.opts.max_waiting)
      return make_error(ErrorCode::kResourceExhausted, "the server is overloaded: {} requests are waiting",
                        m.opts.max_waiting);
    s->seed = req.sampling.seed ? *req.sampling.seed : m.seed_source();
    s->arrival = ++m.arrivals;
    if (!req.adapter.empty()) m.registry->add_user(req.adapter, +1);
    m.live_ids.insert(req.id);
    m.counters.prompt_tokens_total += req.prompt.size();
    s->req = std::move(req);
    m.incoming.push_back(std::move(s));
  }
  m.cv.notify_one();
  return {};
}

void Engine::cancel(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (!impl_->live_ids.count(request_id)) return;
    impl_->cancels.push_back(request_id);
  }
  impl_->cv.notify_one();
}

Status Engine::load_adapter(const std::string& name, const std::string& path, bool pinned) {
  return load_adapter(name, path, AdapterLoadSpec{pinned, false, impl_->opts.lora_root});
}

Status Engine::load_adapter(const std::string& name, const std::string& path, const AdapterLoadSpec& spec) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.draining.count(name))
      return make_error(ErrorCode::kFailedPrecondition, "adapter '{}' is being unloaded", name);
    if (!spec.replace && m.registry->contains(name))
      return make_error(ErrorCode::kAlreadyExists, "an adapter named '{}' is already loaded", name);
  }
  // Read and validated without the lock: a slow disk (or a hostile file) delays this call only,
  // never a step or another request.
  MOELORA_ASSIGN_OR_RETURN(AdapterRegistry::Prepared prepared, m.registry->prepare(name, path, spec.root));
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.draining.count(name))
    return make_error(ErrorCode::kFailedPrecondition, "adapter '{}' is being unloaded", name);
  // The scheduler reads the registry under this lock, so the swap happens between steps.
  return m.registry->commit(name, std::move(prepared), spec.pinned, spec.replace);
}

Status Engine::add_adapter(const std::string& name, std::shared_ptr<const LoraAdapter> adapter) {
  // Stored as the slots take them (see AdapterLoadOptions::factor_dtype), converted here on the
  // caller's thread once rather than at every placement (on the slot pool's worker).
  if (const DType dt = impl_->backend->lora_dtype(); !factors_are(*adapter, dt)) {
    auto copy = std::make_shared<LoraAdapter>(*adapter);
    convert_adapter_factors(*copy, dt);
    adapter = std::move(copy);
  }
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->registry->add_in_memory(name, std::move(adapter));
}

Status Engine::unload_adapter(const std::string& name, bool wait) {
  Impl& m = *impl_;
  uint64_t generation = 0;
  {
    std::unique_lock<std::mutex> lk(m.mu);
    if (!m.registry->contains(name)) return not_found("no adapter named '{}' is loaded", name);
    if (m.registry->users(name) > 0 && !wait)
      return make_error(ErrorCode::kFailedPrecondition, "adapter '{}' is used by {} request(s); retry when they finish",
                        name, m.registry->users(name));
    m.draining.insert(name);
    generation = m.registry->generation(name);
  }
  // Wait for its requests, then drop it on the engine thread (slot tables are engine-owned).
  for (;;) {
    std::promise<bool> done;
    auto fut = done.get_future();
    run_on_engine_thread([&] {
      // A concurrent unload already dropped this load of the adapter; the name may even hold a
      // newer load by now, which is not ours to remove.
      if (m.registry->generation(name) != generation) {
        done.set_value(true);
        return;
      }
      if (m.registry->users(name) > 0) {
        done.set_value(false);
        return;
      }
      if (auto a = m.registry->get(name); a.ok()) m.slots->evict(a->get());
      (void)m.registry->remove(name);
      m.draining.erase(name);
      done.set_value(true);
    });
    if (fut.get()) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<AdapterInfo> Engine::adapters() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  std::vector<AdapterInfo> out;
  for (const auto& i : impl_->registry->list()) {
    AdapterInfo a;
    a.name = i.name;
    a.path = i.path;
    a.pinned = i.pinned;
    a.on_host = i.on_host;
    a.max_rank = i.max_rank;
    a.generation = i.generation;
    out.push_back(a);
  }
  return out;
}

bool Engine::has_adapter(const std::string& name) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->registry->contains(name) && !impl_->draining.count(name);
}

EngineStats Engine::stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  EngineStats s = m.counters;
  s.num_running = m.scheduler->num_running();
  s.num_waiting = m.scheduler->num_waiting() + static_cast<int>(m.incoming.size());
  s.kv_pages_total = m.pages->total_pages();
  s.kv_pages_used = m.pages->used_pages();
  s.kv_pages_cached = m.pages->cached_only_pages();
  s.lora_slots_total = m.slots->num_slots();
  s.lora_slots_used = m.slots->used_slots();
  s.lora_slots_loading = m.slots->loading_slots();
  s.penalty_slots_total = m.backend->penalty_slots();
  s.penalty_slots_used = m.penalty_slots->used.load();
  std::set<std::string> run, wait;
  for (const auto& q : m.scheduler->running())
    if (!q->req.adapter.empty()) run.insert(q->req.adapter);
  for (const auto& q : m.scheduler->waiting())
    if (!q->req.adapter.empty()) wait.insert(q->req.adapter);
  for (const auto& q : m.incoming)
    if (!q->req.adapter.empty()) wait.insert(q->req.adapter);
  s.running_adapters.assign(run.begin(), run.end());
  s.waiting_adapters.assign(wait.begin(), wait.end());
  s.num_preemptions_total = m.scheduler->preemptions();
  s.prefix_cache_queries_total = m.scheduler->prefix_queries();
  s.prefix_cache_hits_total = m.scheduler->prefix_hits();
  return s;
}

void Engine::run_on_engine_thread(const std::function<void()>& fn) {
  std::promise<void> done;
  auto fut = done.get_future();
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->stopping) {
      fn();
      return;
    }
    impl_->tasks.push_back([&] {
      fn();
      done.set_value();
    });
  }
  impl_->cv.notify_one();
  fut.wait();
}

void Engine::stop() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->stopping) return;
    impl_->stopping = true;
  }
  impl_->cv.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
  // Cancels the placements in flight and joins the slot pool's worker, which would otherwise
  // notify mu/cv (destroyed before the pool) when its placement ends.
  impl_->slots->shutdown();
}

}  // namespace moelora
