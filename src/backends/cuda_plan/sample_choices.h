// Per-batch choice of the CUDA sampling kernel's cluster size (kernels/sampling.cu), made on the
// host from the batch alone (tests/cuda_plan checks it without a GPU). The kernel's results are
// identical for every cluster size, so this choice is about time only.
#pragma once

#include <array>

namespace moelora::cuda_plan {

// Blocks per row (2, 4, 8 or 16) for `rows` rows, given how many clusters of each size the device
// holds at once (max_active[i]: clusters of 2^i blocks; 0 = that size cannot run).
//
// The batch takes about waves(C) x row_us(C), waves(C) = ceil(rows / max_active[C]), with row_us
// one row's time on C blocks as measured on the H200 (dev/sampling.cu run 3, bench/RESULTS.md
// "Sampler": 151,936 tokens, top-p 0.9: 753 / 391 / 210 / 135 us on 2 / 4 / 8 / 16 blocks; 16 is
// not twice as fast as 8). Against the same run it picks the measured best at 1, 8, 64, 128 and
// 256 rows; at 32 it picks 4 blocks (758 us) where 8 took 598 (two blocks sharing an SM slow each
// other, which the model ignores). The smaller C on a tie (fewer waves). 2 if no size can run.
// These row times predate the sparse passes (kernels/sampling.cu for_row_sparse) and the single
// log-sum-exp accumulator of pass 1: the per-row cost changed, so they need re-measuring (dev/sampling.cu).
int choose_sample_cluster(int rows, const std::array<int, 5>& max_active);

}  // namespace moelora::cuda_plan
