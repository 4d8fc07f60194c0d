// Logit processing and penalty slots on the device (sampling.cuh): the processed rows the sampler
// reads, and the slots' counts. The sampling kernel itself is sample_kernel.cu.
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/sampling.cuh"

namespace moelora::cuda {
namespace {

// A processed row: the raw row (or -inf everywhere for restrict_to_allowed), and for a row with a
// penalty slot every token its cell gives an edit, edited from the raw value (the row's own edits
// follow in edit_kernel, which overwrites their tokens with the merged edit).
__global__ void __launch_bounds__(256) process_kernel(ProcessParams p) {
  const int pr = blockIdx.y;
  const int r = p.processed_rows[pr];
  const DeviceSampleRow& row = p.rows[r];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  float* out = p.processed + static_cast<int64_t>(pr) * p.vocab;
  const bool restrict_rows = row.restrict_to_allowed != 0;
  const uint32_t* cells = row.penalty_slot >= 0 ? p.penalty_cells + static_cast<int64_t>(row.penalty_slot) * p.vocab : nullptr;
  const bool ctx = penalty_wants_context(row.repetition), outp = penalty_wants_output(row.presence, row.frequency);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.vocab; i += gridDim.x * blockDim.x) {
    float v = restrict_rows ? -INFINITY : raw[i];
    if (cells && !restrict_rows) {
      const uint32_t cell = cells[i];
      if (penalty_cell_edits(cell, ctx, outp)) {
        LogitEdit e;
        e.token = i;
        v = sampling::apply_edit(v, penalty_merge(e, cell, ctx, outp), row.presence, row.frequency, row.repetition);
      }
    }
    out[i] = v;
  }
}

__global__ void __launch_bounds__(256) edit_kernel(ProcessParams p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_edits) return;
  const int r = p.edit_rows[e];
  const DeviceSampleRow& row = p.rows[r];
  LogitEdit ed = p.edits[e];
  if (row.restrict_to_allowed && !ed.allowed) return;
  if (row.penalty_slot >= 0)
    ed = penalty_merge(ed, p.penalty_cells[static_cast<int64_t>(row.penalty_slot) * p.vocab + ed.token],
                       penalty_wants_context(row.repetition), penalty_wants_output(row.presence, row.frequency));
  const float raw = p.logits[static_cast<int64_t>(r) * p.ld + ed.token];
  p.processed[static_cast<int64_t>(row.processed) * p.vocab + ed.token] =
      sampling::apply_edit(raw, ed, row.presence, row.frequency, row.repetition);
}

__global__ void __launch_bounds__(256) penalty_commit_kernel(const DeviceSampleRow* rows, const DeviceSampleResult* out,
                                                             int num_rows, uint32_t* cells, int vocab) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows || rows[r].penalty_slot < 0) return;
  const int token = out[r].token;
  if (token < 0 || token >= vocab) return;  // never (the sampler draws inside the row); no stray write if it did
  uint32_t& cell = cells[static_cast<int64_t>(rows[r].penalty_slot) * vocab + token];
  cell = penalty_count(cell, /*generated=*/true);  // rows never share a slot (check_sample_rows)
}

// Block (x, s): cells x * 1024 .. of slot slots[s], 4 per thread.
__global__ void __launch_bounds__(256) penalty_clear_kernel(uint32_t* cells, int vocab, const int32_t* slots) {
  uint32_t* slot = cells + static_cast<int64_t>(slots[blockIdx.y]) * vocab;
  for (int i = blockIdx.x * 1024 + threadIdx.x, e = min(vocab, (blockIdx.x + 1) * 1024); i < e; i += 256) slot[i] = 0u;
}

__global__ void __launch_bounds__(256) penalty_scatter_kernel(uint32_t* cells, int vocab, const int32_t* tokens,
                                                              const int32_t* slot_gen, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t* cell = cells + static_cast<int64_t>(slot_gen[i] >> 1) * vocab + tokens[i];
  if (slot_gen[i] & 1) atomicAdd(cell, 1u);  // penalty_count, split into two atomics (counts < 2^31)
  atomicOr(cell, kPenaltyInContext);
}


}  // namespace

void launch_process_logits(const ProcessParams& p, cudaStream_t stream) {
  if (p.num_processed > 0) {
    const dim3 grid((p.vocab + 256 * 8 - 1) / (256 * 8), p.num_processed);
    process_kernel<<<grid, 256, 0, stream>>>(p);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
  if (p.num_edits > 0) {
    edit_kernel<<<(p.num_edits + 255) / 256, 256, 0, stream>>>(p);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

void launch_penalty_commit(const DeviceSampleRow* rows, const DeviceSampleResult* out, int num_rows, uint32_t* cells,
                           int vocab, cudaStream_t stream) {
  if (num_rows <= 0) return;
  penalty_commit_kernel<<<(num_rows + 255) / 256, 256, 0, stream>>>(rows, out, num_rows, cells, vocab);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_penalty_reset(uint32_t* cells, int vocab, const int32_t* slots, int num_slots, const int32_t* tokens,
                          const int32_t* slot_gen, int n, cudaStream_t stream) {
  MOELORA_CHECK(num_slots >= 0 && num_slots <= 65535 && vocab > 0);
  if (num_slots > 0) {
    penalty_clear_kernel<<<dim3((vocab + 1023) / 1024, num_slots), 256, 0, stream>>>(cells, vocab, slots);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
  if (n <= 0) return;
  penalty_scatter_kernel<<<(n + 255) / 256, 256, 0, stream>>>(cells, vocab, tokens, slot_gen, n);
  MOELORA_CUDA_CHECK_LAUNCH();
}


}  // namespace moelora::cuda
