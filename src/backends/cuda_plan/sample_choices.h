// Per-batch choice of the CUDA sampling kernel's cluster size (kernels/sample_kernel.cu), made on the
// host from the batch alone (tests/cuda_plan checks it without a GPU). The kernel's results are
// identical for every cluster size, so this choice is about time only.
#pragma once

#include <array>

namespace moelora::cuda_plan {

// Blocks per row (2, 4, 8 or 16) for `rows` rows, given how many clusters of each size the device
// holds at once (max_active[i]: clusters of 2^i blocks; 0 = that size cannot run): the size of
// least sample_batch_us, the smaller C on a tie, 2 if no size can run.
//
// The model: rows run in waves of max_active clusters; a full wave takes whole_us(C), a wave of
// n < max_active rows one_us(C) + (whole_us - one_us) (n - 1) / (max_active - 1) (the rows of a wave share SMs,
// two blocks each, and the L2: a full wave is slower than one row alone). Both measured on the
// H200 (dev/sampling.cu, 2026-12-06, bench/RESULTS.md "Sampler": 151,936 tokens, temperature 0.8,
// top-p 0.9, peaked logits): one row 183 / 102 / 61 / 48 us and a full wave 288 / 137 / 86 / 67 us
// on 2 / 4 / 8 / 16 blocks. Against that run it picks the measured best at 1, 8, 64, 128 and 256
// rows; at 32 it picks 4 blocks (150 us) where 8 took 144.
int choose_sample_cluster(int rows, const std::array<int, 5>& max_active);

// The model's time (us) of `rows` rows on clusters of 2^size_index blocks, max_active at once.
double sample_batch_us(int rows, int size_index, int max_active);

}  // namespace moelora::cuda_plan
