// CudaBackend::sample: packs the rows' parameters and edits into one pinned buffer, uploads it
// with one copy, runs the kernels of kernels/sampling.cuh on the main stream after the step, and
// reads back only the results (token, logprob, top logprobs) through pinned memory. Buffers grow
// to the largest batch seen and are then reused: a steady decode allocates nothing.
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

std::vector<SampleOutput> CudaBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows) {
  const int R = static_cast<int>(rows.size());
  MOELORA_CHECK(logits.device() == Device::kCuda && logits.dtype() == DType::kF32 && logits.rows() == R);
  if (R == 0) return {};
  if (!sampler_) sampler_ = std::make_unique<Sampler>();
  Sampler& s = *sampler_;
  const int V = static_cast<int>(logits.cols());

  // Layout of the upload: rows | processed-row map | edits | edit rows.
  int num_processed = 0;
  size_t num_edits = 0;
  for (const SampleRow& r : rows) {
    MOELORA_CHECK(r.logprobs >= 0 && r.logprobs <= kMaxTopLogprobs);
    if (r.has_processing()) ++num_processed, num_edits += r.edits.size();
  }
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
