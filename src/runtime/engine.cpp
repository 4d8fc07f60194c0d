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

int derive_kv_pages(const EngineOptions& o, const ModelConfig& c, int max_len, DType act) {
  if (o.kv_num_pages > 0) return o.kv_num_pages;
  const int per_seq = (max_len + o.kv_page_size - 1) / o.kv_page_size;
  const size_t page_bytes = static_cast<size_t>(c.num_layers) * o.kv_page_size * c.attn_kv_heads() *
                            (c.attn_k_head_dim() + c.attn_v_head_dim()) * dtype_size(act);
  const size_t wanted = static_cast<size_t>(per_seq) * o.max_num_seqs;
  const size_t cap = std::max<size_t>(per_seq, o.kv_cache_bytes / page_bytes);
  return static_cast<int>(std::min(wanted, cap));
}

Status validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return invalid_argument("temperature must be a finite number >= 0, got {}", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1], got {}", p.top_p);
  if (p.top_k < 0) return invalid_argument("top_k must be >= 0 (0 disables it), got {}", p.top_k);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return invalid_argument("min_p must be in [0, 1], got {}", p.min_p);
  if (p.max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", p.max_tokens);
  if (p.logprobs < 0 || p.logprobs > 20) return invalid_argument("logprobs must be in [0, 20], got {}", p.logprobs);
  return {};
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

  void loop() {
    for (;;) {
      std::vector<Delivery> deliveries;
      ScheduledStep step;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] {
          return stopping || !incoming.empty() || !cancels.empty() || !tasks.empty() || scheduler->num_running() > 0 ||
                 scheduler->num_waiting() > 0;
        });
        if (stopping) break;
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
        step = scheduler->schedule(&failed);
        for (auto& [s, st] : failed) finish(std::move(s), FinishReason::kError, st, &deliveries);
      }
      if (step.batch.num_tokens() > 0) {
        // The forward pass runs without the lock: submit/cancel/stats stay responsive.
        Tensor logits = model->forward(step.batch, kv, &slots->tables());
        std::lock_guard<std::mutex> lk(mu);
        scheduler->step_done(step);
        counters.steps_total++;
        const int V = model->config().vocab_size;
        for (size_t r = 0; r < step.samplers.size(); ++r) {
          Sequence* s = step.samplers[r];
          const float* row = logits.ptr<float>() + static_cast<int64_t>(r) * V;
          SampleResult sr = sample_token(row, V, s->req.sampling, s->rng);
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
                                               const EngineOptions& opts) {
  if (opts.max_num_seqs < 1 || opts.max_batch_tokens < 1 || opts.kv_page_size < 1 || opts.max_loras_per_batch < 1 ||
      opts.max_loaded_loras < opts.max_loras_per_batch)
    return invalid_argument("engine options out of range (max_loaded_loras must be >= max_loras_per_batch)");
  auto impl = std::make_unique<Impl>();
  impl->opts = opts;
  const ModelConfig& cfg = model->config();
  impl->max_len = opts.max_model_len > 0 ? opts.max_model_len : cfg.max_position_embeddings;
  const int num_pages = derive_kv_pages(opts, cfg, impl->max_len, backend->act_dtype());
  impl->kv = model->alloc_kv_cache(num_pages, opts.kv_page_size);
  impl->pages = std::make_unique<KvCacheManager>(num_pages, opts.kv_page_size, opts.enable_prefix_cache);
  impl->slots = std::make_unique<LoraSlotPool>(cfg, *backend, opts.max_loras_per_batch);
  impl->registry = std::make_unique<AdapterRegistry>(cfg, AdapterLoadOptions{opts.max_lora_rank},
                                                     opts.max_loaded_loras, opts.lora_root);
  impl->scheduler = std::make_unique<Scheduler>(opts, *impl->pages, *impl->slots, *impl->registry);
  impl->backend = std::move(backend);
  impl->model = std::move(model);
  MOELORA_LOG_INFO("engine: {} on {}, {} KV pages of {} positions, {} adapter slots, max model length {}",
                   arch_name(cfg.arch), impl->backend->name(), num_pages, opts.kv_page_size, opts.max_loras_per_batch,
                   impl->max_len);
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
  MOELORA_RETURN_IF_ERROR(validate_sampling(req.sampling));
  if (req.prompt.empty()) return invalid_argument("the prompt is empty");
  const int V = m.model->config().vocab_size;
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
  auto s = std::make_unique<Sequence>();
  s->tokens = req.prompt;
  s->prompt_len = static_cast<int>(req.prompt.size());
  s->on_output = std::move(on_output);
  s->submitted = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.stopping) return make_error(ErrorCode::kFailedPrecondition, "the engine is shutting down");
    if (m.live_ids.count(req.id)) return make_error(ErrorCode::kAlreadyExists, "request id '{}' is in use", req.id);
    if (!req.adapter.empty() && (!m.registry->contains(req.adapter) || m.draining.count(req.adapter)))
      return not_found("The model `{}` does not exist.", req.adapter);
    if (static_cast<int>(m.incoming.size()) + m.scheduler->num_waiting() >= m.opts.max_waiting)
      return make_error(ErrorCode::kResourceExhausted, "the server is overloaded: {} requests are waiting",
                        m.opts.max_waiting);
    s->rng.seed(req.sampling.seed ? *req.sampling.seed : m.seed_source());
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
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  // Loading reads and validates the files under the lock: simple, and loads are rare.
  if (m.draining.count(name))
    return make_error(ErrorCode::kFailedPrecondition, "adapter '{}' is being unloaded", name);
  return m.registry->load(name, path, pinned);
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
}

}  // namespace moelora
