// CudaBackend::sample: packs the rows' parameters and edits into one pinned buffer, uploads it
// with one copy, runs the kernels of kernels/sampling.cuh on the main stream after the step, and
// reads back only the results (token, logprob, top logprobs) through pinned memory. Buffers grow
// to the largest batch seen and are then reused: a steady decode allocates nothing.
#include <algorithm>
#include <cstring>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_backend_internal.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/sampling.cuh"
#include "backends/cuda_plan/sample_choices.h"

namespace moelora {

namespace {
size_t align16(size_t n) { return (n + 15) & ~size_t{15}; }
}  // namespace

void CudaBackend::reserve_sampling(int rows, int vocab) {
  if (!sampler_) sampler_ = std::make_unique<Sampler>();
  sampler_->out.reserve(static_cast<size_t>(rows) * sizeof(cuda::DeviceSampleResult));
  sampler_->processed_rows(static_cast<size_t>(rows) * vocab * sizeof(float));
}

void CudaBackend::reserve_penalty_slots(int n, int vocab) {
  MOELORA_CHECK(n >= 0 && vocab > 0);
  if (!sampler_) sampler_ = std::make_unique<Sampler>();
  Sampler& s = *sampler_;
  if (s.penalty_cells) MOELORA_CUDA_CHECK(cudaFree(s.penalty_cells));
  s.penalty_cells = nullptr;
  s.penalty_slots = n, s.penalty_vocab = vocab;
  s.reset_slots.clear(), s.reset_tokens.clear(), s.reset_slot_gen.clear();
  if (n == 0) return;
  const size_t bytes = static_cast<size_t>(n) * vocab * sizeof(uint32_t);
  MOELORA_CUDA_CHECK(cudaMalloc(&s.penalty_cells, bytes));
  MOELORA_CUDA_CHECK(cudaMemsetAsync(s.penalty_cells, 0, bytes, main_));  // ordered before every sampler kernel
}

int CudaBackend::penalty_slots() const { return sampler_ ? sampler_->penalty_slots : 0; }

void CudaBackend::penalty_reset(int slot, const std::vector<int32_t>& tokens, int prompt_len) {
  MOELORA_CHECK_MSG(sampler_ && slot >= 0 && slot < sampler_->penalty_slots, "penalty slot {} of {}", slot,
                    penalty_slots());
  Sampler& s = *sampler_;
  for (int32_t t : tokens) MOELORA_CHECK_MSG(t >= 0 && t < s.penalty_vocab, "token {} outside the vocabulary", t);
  // A slot reset twice before the next sample() keeps only its last reset.
  if (std::find(s.reset_slots.begin(), s.reset_slots.end(), slot) != s.reset_slots.end()) {
    size_t w = 0;
    for (size_t i = 0; i < s.reset_tokens.size(); ++i)
      if ((s.reset_slot_gen[i] >> 1) != slot) s.reset_tokens[w] = s.reset_tokens[i], s.reset_slot_gen[w++] = s.reset_slot_gen[i];
    s.reset_tokens.resize(w), s.reset_slot_gen.resize(w);
  } else {
    s.reset_slots.push_back(slot);
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    s.reset_tokens.push_back(tokens[i]);
    s.reset_slot_gen.push_back((slot << 1) | (static_cast<int>(i) >= prompt_len ? 1 : 0));
  }
}

// The queued penalty resets, in stream order before this sample()'s kernels.
void CudaBackend::apply_penalty_resets() {
  Sampler& s = *sampler_;
  if (s.reset_slots.empty()) return;
  // One upload (slots | tokens | their slot and generated bit) and one clear + one scatter launch,
  // however many sequences took a slot this step.
  const size_t n = s.reset_tokens.size(), ns = s.reset_slots.size();
  const size_t slot_bytes = align16(ns * sizeof(int32_t)), half = align16(n * sizeof(int32_t));
  s.reset.reserve(slot_bytes + 2 * half);
  char* h = static_cast<char*>(s.reset.host);
  std::memcpy(h, s.reset_slots.data(), ns * sizeof(int32_t));
  std::memcpy(h + slot_bytes, s.reset_tokens.data(), n * sizeof(int32_t));
  std::memcpy(h + slot_bytes + half, s.reset_slot_gen.data(), n * sizeof(int32_t));
  char* d = static_cast<char*>(s.reset.dev);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(d, h, slot_bytes + 2 * half, cudaMemcpyHostToDevice, main_));
  cuda::launch_penalty_reset(s.penalty_cells, s.penalty_vocab, reinterpret_cast<const int32_t*>(d), static_cast<int>(ns),
                             reinterpret_cast<const int32_t*>(d + slot_bytes),
                             reinterpret_cast<const int32_t*>(d + slot_bytes + half), static_cast<int>(n), main_);
  s.reset_slots.clear(), s.reset_tokens.clear(), s.reset_slot_gen.clear();
}

std::vector<SampleOutput> CudaBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows) {
  const int R = static_cast<int>(rows.size());
  MOELORA_CHECK(logits.device() == Device::kCuda && logits.dtype() == DType::kF32 && logits.rows() == R);
  if (R == 0) return {};
  if (!sampler_) sampler_ = std::make_unique<Sampler>();
  Sampler& s = *sampler_;
  const int V = static_cast<int>(logits.cols());
  check_sample_rows(rows, V, s.penalty_slots, s.penalty_vocab);
  apply_penalty_resets();
  bool penalised = false;
  for (const SampleRow& r : rows) penalised = penalised || r.penalty_slot >= 0;

  // Layout of the upload: rows | processed-row map | edits | edit rows.
  int num_processed = 0;
  size_t num_edits = 0;
  for (const SampleRow& r : rows)
    if (r.has_processing()) ++num_processed, num_edits += r.edits.size();
  const size_t off_rows = 0;
  const size_t off_prow = align16(off_rows + R * sizeof(cuda::DeviceSampleRow));
  const size_t off_edits = align16(off_prow + num_processed * sizeof(int32_t));
  const size_t off_erow = align16(off_edits + num_edits * sizeof(LogitEdit));
  const size_t total = align16(off_erow + num_edits * sizeof(int32_t));
  s.in.reserve(total);
  char* h = static_cast<char*>(s.in.host);
  auto* drows = reinterpret_cast<cuda::DeviceSampleRow*>(h + off_rows);
  auto* prow = reinterpret_cast<int32_t*>(h + off_prow);
  auto* edits = reinterpret_cast<LogitEdit*>(h + off_edits);
  auto* erow = reinterpret_cast<int32_t*>(h + off_erow);
  int np = 0;
  size_t ne = 0;
  for (int i = 0; i < R; ++i) {
    const SampleRow& r = rows[i];
    cuda::DeviceSampleRow& d = drows[i];
    d.temperature = r.temperature, d.top_p = r.top_p, d.min_p = r.min_p;
    d.presence = r.presence, d.frequency = r.frequency, d.repetition = r.repetition;
    d.top_k = r.top_k, d.logprobs = r.logprobs, d.seed = r.seed, d.step = r.step;
    d.restrict_to_allowed = r.restrict_to_allowed ? 1 : 0;
    d.penalty_slot = r.penalty_slot;
    d.processed = -1;
    if (!r.has_processing()) continue;
    d.processed = np;
    prow[np++] = i;
    for (const LogitEdit& e : r.edits) {
      MOELORA_CHECK(e.token >= 0 && e.token < V);
      edits[ne] = e;
      erow[ne++] = i;
    }
  }
  char* dbase = static_cast<char*>(s.in.dev);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(dbase, h, total, cudaMemcpyHostToDevice, main_));

  float* processed = nullptr;
  if (num_processed > 0) {
    processed = s.processed_rows(static_cast<size_t>(num_processed) * V * sizeof(float));
    cuda::ProcessParams pp;
    pp.logits = logits.ptr<float>(), pp.ld = logits.ld(), pp.vocab = V;
    pp.rows = reinterpret_cast<const cuda::DeviceSampleRow*>(dbase + off_rows);
    pp.processed = processed;
    pp.processed_rows = reinterpret_cast<const int32_t*>(dbase + off_prow);
    pp.num_processed = num_processed;
    pp.edits = reinterpret_cast<const LogitEdit*>(dbase + off_edits);
    pp.edit_rows = reinterpret_cast<const int32_t*>(dbase + off_erow);
    pp.num_edits = static_cast<int>(num_edits);
    pp.penalty_cells = s.penalty_cells;
    cuda::launch_process_logits(pp, main_);
  }
  s.out.reserve(R * sizeof(cuda::DeviceSampleResult));
  cuda::SampleParams sp;
  sp.logits = logits.ptr<float>(), sp.ld = logits.ld(), sp.rows = R, sp.vocab = V;
  sp.params = reinterpret_cast<const cuda::DeviceSampleRow*>(dbase + off_rows);
  sp.processed = processed;
  sp.out = static_cast<cuda::DeviceSampleResult*>(s.out.dev);
  if (!s.clusters_known) s.max_active_clusters = cuda::sample_max_active_clusters(), s.clusters_known = true;
  sp.cluster = cuda_plan::choose_sample_cluster(R, s.max_active_clusters);
  cuda::launch_sample(sp, main_);
  if (penalised) cuda::launch_penalty_commit(sp.params, sp.out, R, s.penalty_cells, V, main_);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(s.out.host, s.out.dev, R * sizeof(cuda::DeviceSampleResult),
                                     cudaMemcpyDeviceToHost, main_));
  sync_main();

  std::vector<SampleOutput> result(R);
  const auto* res = static_cast<const cuda::DeviceSampleResult*>(s.out.host);
  for (int i = 0; i < R; ++i) {
    result[i].token = res[i].token;
    result[i].logprob = res[i].logprob;
    const int n = std::min(rows[i].logprobs, V);
    for (int j = 0; j < n; ++j) result[i].top_logprobs.emplace_back(res[i].top_ids[j], res[i].top_logprobs[j]);
  }
  return result;
}

}  // namespace moelora
