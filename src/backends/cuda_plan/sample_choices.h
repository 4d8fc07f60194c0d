// Per-batch choice of the CUDA sampling kernel's cluster size (kernels/sampling.cu), made on the
// host from the batch alone (tests/cuda_plan checks it without a GPU). The kernel's results are
// identical for every cluster size, so this choice is about time only.
#pragma once

#include <array>

namespace moelora::cuda_plan {

// Blocks per row (a power of two up to 16) for `rows` rows, given how many clusters of each size
// the device holds at once (max_active[i]: clusters of 2^i blocks; 0 = that size cannot run).
//
// Measured on the H200 (dev/sampling.cu, bench/RESULTS.md "Sampler"): a row takes a time
// inversely proportional to its blocks (151,936 tokens: 1448 / 738 / 382 / 203 us on 1 / 2 / 4 / 8
// blocks), and rows beyond the resident clusters run in further waves of the same length. So the
// batch takes about waves(C) / C, waves(C) = ceil(rows / max_active[C]); the smallest wins, the
// larger C on a tie (fewer rows per SM share its issue slots). 1 if no size can run.
int choose_sample_cluster(int rows, const std::array<int, 5>& max_active);

}  // namespace moelora::cuda_plan
