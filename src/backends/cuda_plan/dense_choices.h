// Per-shape choices of the CUDA dense projection and decode attention kernels, made on the host
// from the problem alone (tests/cuda_plan checks them without a GPU). The kernel files launch what
// is chosen here; each threshold cites the measurement it comes from (bench/RESULTS.md).
#pragma once

namespace moelora::cuda_plan {

// ---- Dense projection y = x W^T (kernels/dense_gemm.cu).
enum class DensePath {
  kSmallM,    // our memory-bound small-M kernel (decode)
  kCublasLt,  // cuBLASLt (bf16 GEMM, or FP8 block-scaled after quantising the activations)
};
DensePath choose_dense_path(int M, bool fp8_weights);

// Tiling of the small-M kernel: `m_tiles` 8-token tiles per block (1, 2, 4 or 8), `row_groups`
// 16-row weight tiles per block and `k_warps` warps splitting K (row_groups * k_warps <= 8).
struct DenseSmallMTiling {
  int m_tiles = 1;
  int row_groups = 1;
  int k_warps = 1;
};
// `in` is the reduction length; row_groups / k_warps > 0 force those values (the workbench sweeps
// them), 0 = the measured default.
DenseSmallMTiling choose_dense_small_m_tiling(int M, int in, int row_groups = 0, int k_warps = 0);

// ---- Decode attention split over the KV positions (kernels/attention.cu).
struct AttentionDecodeSplit {
  int chunk = 0;       // positions per split (a multiple of 64, at least 128)
  int max_splits = 1;  // splits of the longest sequence
};
// T tokens (one per sequence), kv_heads KV heads with `group` query heads each, the longest
// context `max_positions`, on a GPU of `num_sms` SMs.
AttentionDecodeSplit choose_attention_decode_split(int T, int kv_heads, int group, int max_positions, int num_sms);

}  // namespace moelora::cuda_plan
