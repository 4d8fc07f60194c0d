#include "runtime/scheduler.h"

#include <algorithm>

#include "core/check.h"

namespace moelora {

Scheduler::Scheduler(const EngineOptions& opts, KvCacheManager& kv, LoraSlotPool& slots, AdapterRegistry& registry)
    : opts_(opts), kv_(kv), slots_(slots), registry_(registry) {}

void Scheduler::add(std::unique_ptr<Sequence> seq) { waiting_.push_back(std::move(seq)); }

bool Scheduler::ensure_pages(Sequence& s, int upto_tokens) {
  const int P = kv_.page_size();
  while (static_cast<int>(s.pages.size()) * P < upto_tokens) {
    auto p = kv_.allocate();
    if (!p) return false;
    s.pages.push_back(*p);
  }
  return true;
}

void Scheduler::release_resources(Sequence& s) {
  // Full pages of computed tokens go to the prefix cache before this sequence lets go of them.
  kv_.insert_prefix(s.adapter_id, s.tokens, s.pages, s.num_computed / kv_.page_size());
  for (int p : s.pages) kv_.release(p);
  s.pages.clear();
  s.num_computed = 0;
  if (s.slot >= 0) {
    slots_.release(s.slot);
    s.slot = -1;
  }
}

void Scheduler::preempt_youngest(const Sequence* keep) {
  // Youngest = latest arrival; it goes back to the head of the queue and is recomputed.
  auto it = std::max_element(running_.begin(), running_.end(), [&](const auto& a, const auto& b) {
    if ((a.get() == keep) != (b.get() == keep)) return a.get() == keep;  // never pick `keep` first
    return a->arrival < b->arrival;
  });
  MOELORA_CHECK(it != running_.end());
  std::unique_ptr<Sequence> s = std::move(*it);
  running_.erase(it);
  release_resources(*s);
  ++preemptions_;
  waiting_.push_front(std::move(s));
}

Status Scheduler::resolve_adapter(Sequence& s) {
  if (s.adapter) return {};
  // The prefix-cache key is fixed with the weights: a sequence preempted across an in-place reload
  // keeps its old weights and must keep their key too. cache_salt separates users' prefixes.
  MOELORA_ASSIGN_OR_RETURN(s.adapter, registry_.get(s.req.adapter));
  s.adapter_id = prefix_namespace(registry_.generation(s.req.adapter), s.req.cache_salt);
  return {};
}

void Scheduler::fail_waiting(const LoraAdapter* adapter, const Status& why,
                             std::vector<std::pair<std::unique_ptr<Sequence>, Status>>* failed) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    // A request queued since the last scan has not looked its adapter up yet: it may be this one.
    if (!(*it)->req.adapter.empty()) (void)resolve_adapter(**it);  // an error fails it at the scan
    if ((*it)->adapter.get() == adapter) {
      failed->emplace_back(std::move(*it), why);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

ScheduledStep Scheduler::schedule(std::vector<std::pair<std::unique_ptr<Sequence>, Status>>* failed) {
  ScheduledStep step;
  int budget = opts_.max_batch_tokens;
  // Planning can preempt sequences it already looked at; this tells whether one still runs.
  auto running = [this](const Sequence* s) {
    return std::any_of(running_.begin(), running_.end(), [s](const auto& r) { return r.get() == s; });
  };
  std::vector<std::pair<Sequence*, int>> plan;  // (sequence, new tokens)

  // 1. Running sequences: decodes first (one token), then prefill chunks.
  std::vector<Sequence*> order;
  for (auto& s : running_) order.push_back(s.get());
  std::stable_sort(order.begin(), order.end(), [](const Sequence* a, const Sequence* b) {
    const bool da = a->num_computed >= a->prompt_len, db = b->num_computed >= b->prompt_len;
    if (da != db) return da;
    return a->arrival < b->arrival;
  });
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence* s = order[i];
    if (!running(s)) continue;  // preempted below to make room for an older one
    const int remaining = static_cast<int>(s->tokens.size()) - s->num_computed;
    const int n = std::min(remaining, budget);
    if (n <= 0) continue;
    bool ok = ensure_pages(*s, s->num_computed + n);
    while (!ok && running_.size() > 1) {
      preempt_youngest(s);
      if (!running(s)) break;
      ok = ensure_pages(*s, s->num_computed + n);
    }
    if (!ok) {
      // Alone and still out of pages: the request cannot fit; preempting it would loop forever.
      auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == s; });
      if (it != running_.end()) {
        std::unique_ptr<Sequence> dead = std::move(*it);
        running_.erase(it);
        release_resources(*dead);
        failed->emplace_back(std::move(dead), make_error(ErrorCode::kResourceExhausted,
                                                         "the KV cache is too small for this request"));
      }
      continue;
    }
    plan.emplace_back(s, n);
    budget -= n;
  }
  // Drop plan entries of sequences preempted after they were planned.
  plan.erase(std::remove_if(plan.begin(), plan.end(), [&](const auto& e) { return !running(e.first); }), plan.end());

  // 2. Admit waiting requests (FCFS). A request for a resident adapter takes a reference on its
  // slot and runs; one for an absent adapter starts its placement (slot reserved, the copy on the
  // slot pool's worker) and waits; one for a loading adapter waits. Nothing here waits for a copy:
  // poll() (before this) turned finished placements resident, and every other request keeps
  // running meanwhile.
  // Slots go out in arrival order: once a request waits for a slot, younger adapter requests wait
  // too, even for an adapter that is resident; otherwise a steady flow of requests for resident
  // adapters keeps every slot referenced and the waiting one starves. Base-model requests need no
  // slot and still go ahead. Waiting for a placement does not hold the line (its slot is reserved).
  // Past what this step can admit (token budget, max_num_seqs, KV pages) the scan goes on only to
  // start placements in empty slots, so adapters load while earlier requests run; it never evicts
  // there, since a resident adapter may be what an earlier, not yet admitted request needs.
  bool slot_waiter = false, can_admit = true;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    can_admit = can_admit && budget > 0 && static_cast<int>(running_.size()) < opts_.max_num_seqs;
    if (!can_admit && (slot_waiter || !slots_.can_start_placement(/*may_evict=*/false))) break;
    Sequence& s = **it;
    if (!s.req.adapter.empty()) {
      if (slot_waiter) {
        ++it;
        continue;
      }
      if (Status st = resolve_adapter(s); !st.ok()) {
        failed->emplace_back(std::move(*it), st);
        it = waiting_.erase(it);
        continue;
      }
      const LoraSlotPool::State state = slots_.state(s.adapter.get());
      if (state == LoraSlotPool::State::kAbsent) {
        // No slot to take: wait, and hold the line (only while admitting: see above).
        if (!slots_.start_placement(s.adapter, /*may_evict=*/can_admit).ok() && can_admit) slot_waiter = true;
        ++it;
        continue;
      }
      if (state == LoraSlotPool::State::kLoading || !can_admit) {
        ++it;
        continue;
      }
      auto slot = slots_.acquire(s.adapter);  // resident: a reference, at once
      MOELORA_CHECK(slot.ok());
      s.slot = *slot;
    } else if (!can_admit) {
      ++it;
      continue;
    }
    // Prefix cache: reuse full pages, always leaving at least one token to compute.
    const int P = kv_.page_size();
    const int max_pages = (static_cast<int>(s.tokens.size()) - 1) / P;
    s.pages = kv_.match_prefix(s.adapter_id, s.tokens, max_pages);
    s.num_computed = static_cast<int>(s.pages.size()) * P;
    prefix_queries_ += s.tokens.size();
    prefix_hits_ += s.num_computed;
    if (s.generated() == 0) s.cached_tokens = s.num_computed;
    const int n = std::min(static_cast<int>(s.tokens.size()) - s.num_computed, budget);
    if (!ensure_pages(s, s.num_computed + n)) {
      release_resources(s);  // memory pressure: stop admitting this step
      can_admit = false;
      ++it;
      continue;
    }
    plan.emplace_back(&s, n);
    budget -= n;
    running_.push_back(std::move(*it));
    it = waiting_.erase(it);
  }

  // 3. The batch.
  for (auto& [s, n] : plan) {
    const int seq_index = step.batch.num_seqs();
    step.batch.seq_pages.push_back(s->pages);
    for (int i = 0; i < n; ++i) {
      const int pos = s->num_computed + i;
      step.batch.token_ids.push_back(s->tokens[pos]);
      step.batch.positions.push_back(pos);
      step.batch.token_seq.push_back(seq_index);
      step.batch.token_slot.push_back(s->slot);
    }
    step.seqs.push_back(s);
    step.new_tokens.push_back(n);
    if (s->num_computed + n == static_cast<int>(s->tokens.size())) {
      step.batch.logit_rows.push_back(step.batch.num_tokens() - 1);
      step.samplers.push_back(s);
    }
  }
  return step;
}

void Scheduler::step_done(const ScheduledStep& step) {
  for (size_t i = 0; i < step.seqs.size(); ++i) step.seqs[i]->num_computed += step.new_tokens[i];
}

std::unique_ptr<Sequence> Scheduler::remove(const std::string& id) {
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if ((*it)->req.id == id) {
      std::unique_ptr<Sequence> s = std::move(*it);
      running_.erase(it);
      release_resources(*s);
      return s;
    }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if ((*it)->req.id == id) {
      std::unique_ptr<Sequence> s = std::move(*it);
      waiting_.erase(it);
      release_resources(*s);
      return s;
    }
  return nullptr;
}

}  // namespace moelora
