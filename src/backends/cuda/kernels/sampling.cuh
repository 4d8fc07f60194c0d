// Token sampling on the device: Backend::sample (ops/backend.h) for rows of f32 logits, with the
// math of ops/sampling.h. Two launches at most:
//  - launch_process_logits (only when some row has edits): processed rows written to `processed`
//    (a copy of the raw row, or -inf for restrict_to_allowed rows, then each edit applied from
//    the raw value);
//  - launch_sample: one thread-block cluster of `cluster` blocks per row. A pass over the row finds
//    the first token of the order, the processed maximum and the raw log-sum-exp; top-k and top-p
//    boundaries are found by radix selection on the order key (8 bits a pass, counts or
//    fixed-point masses in shared memory, exact integer sums, so the boundary is the reference's);
//    a last pass draws the Gumbel-max token among the kept ones; top logprobs are a radix
//    selection on the raw row.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "ops/sampling.h"

namespace moelora::cuda {

// A row's parameters as the kernels read them (packed by the backend).
struct DeviceSampleRow {
  float temperature, top_p, min_p, presence, frequency, repetition;
  int32_t top_k, logprobs;
  uint64_t seed, step;
  int32_t processed;  // row index into `processed` or -1 (sample from the raw row)
  int32_t restrict_to_allowed;
};

// One row's result as the kernels write it.
struct DeviceSampleResult {
  int32_t token;
  float logprob;
  int32_t top_ids[kMaxTopLogprobs];
  float top_logprobs[kMaxTopLogprobs];
};

struct ProcessParams {
  const float* logits = nullptr;  // raw [rows, ld]
  int64_t ld = 0;
  int vocab = 0;
  const DeviceSampleRow* rows = nullptr;
  float* processed = nullptr;      // [num_processed, vocab]
  const int32_t* processed_rows = nullptr;  // [num_processed]: raw row of each processed row
  int num_processed = 0;
  const LogitEdit* edits = nullptr;  // [num_edits]
  const int32_t* edit_rows = nullptr;  // [num_edits]: raw row of each edit
  int num_edits = 0;
};
void launch_process_logits(const ProcessParams& p, cudaStream_t stream);

struct SampleParams {
  const float* logits = nullptr;  // raw [rows, ld]
  int64_t ld = 0;
  int rows = 0;
  int vocab = 0;
  const DeviceSampleRow* params = nullptr;
  const float* processed = nullptr;
  DeviceSampleResult* out = nullptr;
  int cluster = 8;  // blocks per row: 2, 4, 8 or 16 (cuda_plan::choose_sample_cluster); same results for each
};
void launch_sample(const SampleParams& p, cudaStream_t stream);
// How many clusters of 1, 2, 4, 8 and 16 blocks of the sampling kernel the current device holds at
// once (0: that size cannot run; the kernel takes 2 to 16).
std::array<int, 5> sample_max_active_clusters();

}  // namespace moelora::cuda
