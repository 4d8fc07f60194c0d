// Token sampling on the device: Backend::sample (ops/backend.h) for rows of f32 logits, with the
// math of ops/sampling.h. Two launches at most:
//  - launch_process_logits (only when some row has edits; sampling.cu): processed rows written to
//    `processed` (a copy of the raw row, or -inf for restrict_to_allowed rows, then each edit
//    applied from the raw value);
//  - launch_sample (sample_kernel.cu): one thread-block cluster of `cluster` blocks per row. A pass
//    over the row finds the first token of the order, the processed extremes and the raw
//    log-sum-exp; a second bins every token's exact fixed-point mass by its distance below the
//    top; the top-k / top-p / min-p cuts and the inverse-CDF draw are each found from those bins
//    and one pass that sorts the tokens of one bin (exact integer sums, so every decision is the
//    reference's); top logprobs are a radix selection on the raw row.
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
  int32_t penalty_slot = -1;  // the row's penalty slot (ops/sampling.h) or -1
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
  // Penalty slots [slots, vocab] (rows with penalty_slot >= 0): a processed row applies its slot's
  // cells to every token they give an edit, and the row's own edits are merged with them.
  const uint32_t* penalty_cells = nullptr;
};
void launch_process_logits(const ProcessParams& p, cudaStream_t stream);

// After launch_sample: each row with a penalty slot counts its drawn token there
// (penalty_count(cell, true)). `cells` [slots, vocab].
void launch_penalty_commit(const DeviceSampleRow* rows, const DeviceSampleResult* out, int num_rows,
                           uint32_t* cells, int vocab, cudaStream_t stream);
// Backend::penalty_reset of several slots at once: the `num_slots` slots listed in `slots` are
// zeroed (one launch, whatever their number), then token i (tokens[i], in slot slot_gen[i] >> 1,
// generated when slot_gen[i] & 1) is counted. Counts are sums of integers: the order of the
// threads does not matter.
void launch_penalty_reset(uint32_t* cells, int vocab, const int32_t* slots, int num_slots, const int32_t* tokens,
                          const int32_t* slot_gen, int n, cudaStream_t stream);

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
