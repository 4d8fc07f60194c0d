// CudaBackend, part 3: the step's metadata, CUDA graphs for decode steps, and the fork / join of
// Backend::concurrently (its two branches are what a captured graph records of it).
//
// A decode step (every sequence brings one token, at most kMaxGraphTokens tokens, contexts under
// kGraphMaxPositions) is padded to a bucket (1, 2, 4, ... 256 tokens); padding tokens use no
// adapter, position 0, and a page reserved for them. Per (bucket, any adapter in the batch,
// LoRA rank ceiling) the first such step runs eagerly (warm-up: lazy uploads, cuBLASLt algorithm
// choice), the second is captured, later ones replay. What a replay needs that depends on the
// batch lives in static device memory written before the launch: the step arrays (fixed-capacity
// layout at the start of the arena) and the LoRA grouping plans (re-planned on the host and
// uploaded to the addresses the graph reads, "recipes"). Side-stream MoE LoRA enters the graph
// through event fork/join (kernels/moe_forward); nothing is allocated during capture.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_backend_internal.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/lora_dense.cuh"

namespace moelora {

namespace {
constexpr int kMaxGraphTokens = 256;

int bucket_of(int T) {
  int b = 1;
  while (b < T) b <<= 1;
  return b;
}
}  // namespace

void CudaBackend::raise_rank_ceiling(int rank) {
  int c = lora_rank_ceiling_ ? lora_rank_ceiling_ : 1;
  while (c < rank) c <<= 1;
  if (c != lora_rank_ceiling_ && rank > 0) {
    lora_rank_ceiling_ = c;
    if (graphs_) graphs_->clear();  // graphs sized for the old ceiling are not reused
  }
}

// The step arrays at fixed offsets of the arena (capacities only grow, and growing drops the
// graphs, whose kernels read the old offsets).
void CudaBackend::upload_step_metadata() {
  const StepBatch& b = batch_;
  const int T = b.num_tokens(), S = b.num_seqs(), R = static_cast<int>(b.logit_rows.size());
  std::vector<int32_t> indptr(S + 1, 0), indices;
  for (int s = 0; s < S; ++s) {
    indices.insert(indices.end(), b.seq_pages[s].begin(), b.seq_pages[s].end());
    indptr[s + 1] = static_cast<int32_t>(indices.size());
  }
  const size_t cap_t = std::max<size_t>(opts_.max_step_tokens, T);
  const size_t cap_s = std::max<size_t>(opts_.max_step_seqs, S) + 1;
  const size_t cap_p = std::max<size_t>(8 * cap_s, indices.size());
  if (cap_t > static_cast<size_t>(opts_.max_step_tokens) || cap_s > static_cast<size_t>(opts_.max_step_seqs) + 1 ||
      cap_p > meta_->page_capacity) {
    opts_.max_step_tokens = static_cast<int>(cap_t);
    opts_.max_step_seqs = static_cast<int>(cap_s - 1);
    meta_->page_capacity = cap_p;
    if (graphs_) graphs_->clear();
  }
  meta_->page_capacity = std::max(meta_->page_capacity, cap_p);
  const size_t words = 5 * cap_t + cap_s + meta_->page_capacity;
  if (meta_->pinned_words < words) {
    if (meta_->pinned) MOELORA_CUDA_CHECK(cudaFreeHost(meta_->pinned));
    meta_->pinned_words = words;
    MOELORA_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&meta_->pinned), words * 4, 0));
  }
  int32_t* dev = static_cast<int32_t*>(arena_alloc(words * 4));
  size_t off = 0;
  auto place = [&](const int32_t* src, size_t n, size_t cap, const int32_t** dst) {
    std::memcpy(meta_->pinned + off, src, n * 4);
    *dst = dev + off;
    off += cap;
  };
  place(b.token_ids.data(), T, cap_t, &meta_->token_ids);
  place(b.positions.data(), T, cap_t, &meta_->positions);
  place(b.token_seq.data(), T, cap_t, &meta_->token_seq);
  place(b.token_slot.data(), T, cap_t, &meta_->token_slot);
  place(b.logit_rows.data(), R, cap_t, &meta_->logit_rows);
  place(indptr.data(), indptr.size(), cap_s, &meta_->page_indptr);
  place(indices.data(), indices.size(), meta_->page_capacity, &meta_->page_indices);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(dev, meta_->pinned, off * 4, cudaMemcpyHostToDevice, main_));
}

const StepBatch& CudaBackend::begin_step(const StepBatch& in) {
  if (!graphs_) graphs_ = std::make_unique<Graphs>();
  mode_ = StepMode::kEager;
  batch_ = in;
  const int T = in.num_tokens();
  bool graph = opts_.graphs && pad_page_ >= 0 && T > 0 && T <= kMaxGraphTokens && in.num_seqs() == T &&
               static_cast<int>(in.logit_rows.size()) == T;
  for (int t = 0; graph && t < T; ++t)
    graph = in.token_seq[t] == t && in.logit_rows[t] == t && in.positions[t] < kGraphMaxPositions;
  if (graph) {
    const int bucket = bucket_of(T);
    lora_active_ = false;
    for (int32_t s : in.token_slot) lora_active_ = lora_active_ || s >= 0;
    for (int t = T; t < bucket; ++t) {  // padding: no adapter, position 0, the reserved page
      batch_.token_ids.push_back(0);
      batch_.positions.push_back(0);
      batch_.token_seq.push_back(t);
      batch_.token_slot.push_back(-1);
      batch_.seq_pages.push_back({pad_page_});
      batch_.logit_rows.push_back(t);
    }
    graphs_->key = static_cast<uint64_t>(bucket) | (static_cast<uint64_t>(lora_active_) << 16) |
                   (static_cast<uint64_t>(lora_active_ ? lora_rank_ceiling_ : 0) << 20);
  }
  // The last step took scratch beyond the arena: grow the arena to that peak (plus room) first.
  if (!spills_.empty()) fit_scratch(arena_peak_ + arena_peak_ / 4);
  arena_used_ = 0;
  attn_planned_ = false;
  step_max_positions_ = 0;
  meta_->lora_plans.clear();
  upload_step_metadata();
  meta_->plan_bytes = (8u << 20) + 256u * static_cast<size_t>(batch_.num_tokens());
  meta_->plan_region = static_cast<char*>(arena_alloc(meta_->plan_bytes));
  meta_->plan_used = 0;
  if (!graph) return batch_;

  auto it = graphs_->entries.find(graphs_->key);
  if (it != graphs_->entries.end()) {
    // Replay: re-plan LoRA grouping for this batch into the addresses the graph reads.
    replan_lora(it->second.recipes);
    MOELORA_CUDA_CHECK(cudaGraphLaunch(it->second.exec, main_));
    mode_ = StepMode::kReplay;
  } else if (graphs_->seen[graphs_->key]++ >= 1) {
    capture_recipes_.clear();
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(main_, cudaStreamCaptureModeThreadLocal));
    mode_ = StepMode::kCapture;
  }
  return batch_;
}

// A replayed graph reads one LoRA plan per captured LoRA launch (one to three per layer). Plans
// depend only on the step's slots and the projections' (in, out, slot ranks), so each distinct one
// is planned once; all are staged in pinned memory at their offsets in the plan region and sent
// with one copy per contiguous run (the region is bump-allocated in capture order; only the
// attention metadata sits between runs). One small copy per projection cost ~2 ms of host time per decode step.
void CudaBackend::replan_lora(const std::vector<LoraRecipe>& recipes) {
  if (recipes.empty()) return;
  auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
  char* lo = static_cast<char*>(recipes.front().dev_meta);
  char* hi = lo;
  for (const auto& r : recipes) {
    lo = std::min(lo, static_cast<char*>(r.dev_meta));
    hi = std::max(hi, static_cast<char*>(r.dev_meta) + aligned(r.bytes));
  }
  const size_t span = static_cast<size_t>(hi - lo);
  if (meta_->plan_pinned_bytes < span) {
    if (meta_->plan_pinned) MOELORA_CUDA_CHECK(cudaFreeHost(meta_->plan_pinned));
    meta_->plan_pinned_bytes = span;
    MOELORA_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&meta_->plan_pinned), span, 0));
  }
  struct Planned {
    const LoraRecipe* recipe;
    std::vector<int32_t> meta;
  };
  // Two recipes plan alike when their projections have the same shapes and slot ranks, in order.
  auto same = [](const LoraRecipe& a, const LoraRecipe& b) {
    if (a.capacity != b.capacity || a.tables.size() != b.tables.size()) return false;
    for (size_t i = 0; i < a.tables.size(); ++i)
      if (a.tables[i]->in != b.tables[i]->in || a.tables[i]->out != b.tables[i]->out ||
          a.tables[i]->host_rank != b.tables[i]->host_rank)
        return false;
    return true;
  };
  std::vector<Planned> planned;
  planned.reserve(recipes.size());  // `p` below points into it
  std::vector<std::pair<char*, size_t>> ranges;  // (device address, aligned bytes) in region order
  for (const auto& r : recipes) {
    const Planned* p = nullptr;
    for (const Planned& q : planned)
      if (same(*q.recipe, r)) {
        p = &q;
        break;
      }
    if (!p) {
      std::vector<cuda::LoraProblem> prs;
      for (const LoraModuleTable* t : r.tables) {
        cuda::LoraProblem pr;
        pr.in = t->in;
        pr.out = t->out;
        pr.num_slots = t->num_slots;
        pr.host_rank = t->host_rank.data();
        prs.push_back(pr);
      }
      cuda::LoraPlanOptions po;
      po.single_adapter_gemm = false;  // the graph launched the segmented kernel
      cuda::LoraPlan plan = cuda::lora_plan(batch_.token_slot.data(), batch_.num_tokens(), prs.data(),
                                            static_cast<int>(prs.size()), po, r.capacity);
      planned.push_back({&r, std::move(plan.meta)});
      p = &planned.back();
    }
    const size_t bytes = p->meta.size() * sizeof(int32_t);
    MOELORA_CHECK_MSG(bytes <= r.bytes, "LoRA metadata {} B exceeds the device buffer {} B", bytes, r.bytes);
    char* dst = static_cast<char*>(r.dev_meta);
    std::memcpy(meta_->plan_pinned + (dst - lo), p->meta.data(), bytes);
    ranges.emplace_back(dst, aligned(r.bytes));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    char* begin = ranges[i].first;
    char* end = begin + ranges[i].second;
    size_t j = i + 1;
    while (j < ranges.size() && ranges[j].first == end) end += ranges[j++].second;
    MOELORA_CUDA_CHECK(cudaMemcpyAsync(begin, meta_->plan_pinned + (begin - lo), static_cast<size_t>(end - begin),
                                       cudaMemcpyHostToDevice, main_));
    i = j;
  }
}

void CudaBackend::end_step_body(const Tensor& logits) {
  flush_route();  // a routing no moe() consumed still writes its ids
  if (mode_ != StepMode::kCapture) return;
  cudaGraph_t graph = nullptr;
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(main_, &graph));
  Graphs::Entry e;
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&e.exec, graph, 0));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(graph));
  e.output = logits;
  e.recipes = std::move(capture_recipes_);
  // The capture recorded the work without running it: write this step's LoRA plans (uploads
  // cannot be captured), then run the graph.
  replan_lora(e.recipes);
  MOELORA_CUDA_CHECK(cudaGraphLaunch(e.exec, main_));
  graphs_->entries[graphs_->key] = std::move(e);
}

Tensor CudaBackend::step_output() { return graphs_->entries.at(graphs_->key).output; }

// `first` runs on concurrent_, forked from main_ here and joined back into it at the end (event
// fork / join, which graph capture records as the two branches of the step's graph). Every op
// launches on main_, so main_ names concurrent_ while `first` issues its ops; nothing of `first`
// may consume the routing recorded for `second`'s moe() (flush_route would launch it early, on
// the wrong stream), which the forward pass's shared experts do not touch. Scratch of both comes
// from the one arena: bump allocations never alias.
void CudaBackend::concurrently(const std::function<void()>& first, const std::function<void()>& second) {
  if (!opts_.shared_experts_concurrent) {
    Backend::concurrently(first, second);
    return;
  }
  const bool route_was_pending = route_pending_;
  MOELORA_CUDA_CHECK(cudaEventRecord(ev_fork_, main_));
  MOELORA_CUDA_CHECK(cudaStreamWaitEvent(concurrent_, ev_fork_, 0));
  std::swap(main_, concurrent_);
  // Scratch that `first` gives back (scratch_release once its launches are queued) is still in use
  // on its stream while `second` runs: `second` allocates above the most `first` ever held. (The
  // first H100 run of dev_moe_block, 2026-12-07, hit an illegal address without this: the shared
  // experts' LoRA u buffer, given back, was the routed layer's workspace.)
  const size_t peak_before = arena_peak_;
  arena_peak_ = arena_used_;
  first();
  const size_t first_peak = arena_peak_;
  arena_used_ = std::max(arena_used_, first_peak);
  arena_peak_ = std::max(peak_before, first_peak);
  MOELORA_CUDA_CHECK(cudaEventRecord(ev_join_, main_));
  std::swap(main_, concurrent_);
  MOELORA_CHECK_MSG(route_pending_ == route_was_pending, "Backend::concurrently: the first work consumed a routing");
  second();
  MOELORA_CUDA_CHECK(cudaStreamWaitEvent(main_, ev_join_, 0));
}

}  // namespace moelora
