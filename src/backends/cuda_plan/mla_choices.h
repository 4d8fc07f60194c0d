// Per-call choices of the absorbed-MLA kernels (kernels/mla_attention.cu), made on the host from
// the step's shape alone (tests/cuda_plan checks them without a GPU):
// - how many tokens one pass of the kernels takes: their float32 scratch (the absorbed query, later
//   the latent output, and the kv_b LoRA's rank-r sums) is per token and head, ~256 KiB per token
//   at DeepSeek-V3's 128 heads, so a long prefill chunk runs in passes under a fixed budget;
// - how many KV splits the latent attention may use: its grid is tokens x head groups (of up to 64
//   heads), which at small decode batches leaves most SMs idle (1 token x 2 head groups on 132
//   SMs), so each (token, head group) is split over its positions and the splits are merged
//   afterwards (flash-decoding). The plan fixes the grid's split count from the context bound
//   (a captured graph's, or the eager step's own, whichever is larger), and each token divides its
//   own context over those splits on the device (mla_token_split), so an eager step and the replay
//   of its graph run the same splits and give the same bits;
// - how many output columns a block of each absorption takes (32 or 128): narrow chunks put more
//   blocks in flight for the weight stream of a decode step, wide ones read each token's input row
//   (for the output absorption the float32 latent output, 2 KiB per head) fewer times.
// Nothing here affects results beyond float32 summation order.
#pragma once

#include <cstddef>

namespace moelora::cuda_plan {

// The kernels' constants this plan and shape_limits depend on (mla_attention.cu static_asserts them).
inline constexpr int kMlaMaxHeadsPerBlock = 64;  // latent attention: 4 row groups of 16 heads, 2 warps each
inline constexpr int kMlaTilePositions = 64;     // latent attention: cache rows per shared-memory tile
inline constexpr int kMlaAbsorbTokens = 64;      // absorptions: tokens per block (4 warps x 16 rows)
// The latent attention keeps half of O's R columns per warp in registers (R / 2 / 8 MMA tiles of
// 4 floats: 128 per lane at R = 512) and a cache row of R + rope values, rounded up to 64 (whole
// swizzle groups), in shared memory beside the block's query. DeepSeek-V2/V3 and Kimi K2 use 512 + 64 = 576.
inline constexpr int kMlaMaxLatent = 512;
inline constexpr int kMlaMaxLatentWidth = 768;
inline constexpr int kMlaMaxSplits = 64;          // the merge keeps one weight per split in shared memory
inline constexpr int kMlaMinSplitPositions = 128;  // below this a split is not worth its merge

#if defined(__CUDACC__)
#define MOELORA_MLA_HD __host__ __device__ __forceinline__
#else
#define MOELORA_MLA_HD inline
#endif

// How a token of `n` positions uses a grid of `max_splits` splits: `count` splits of `chunk`
// positions (whole 64-position tiles, the last split shorter), none empty, at least
// kMlaMinSplitPositions per split where the context has them. The kernels and the tests agree
// on it through this one function.
struct MlaTokenSplit {
  int chunk;
  int count;
};
MOELORA_MLA_HD MlaTokenSplit mla_token_split(int n, int max_splits) {
  int want = (n + kMlaMinSplitPositions - 1) / kMlaMinSplitPositions;
  want = want < 1 ? 1 : want;
  const int ns = max_splits < want ? max_splits : want;
  const int chunk = ((n + ns - 1) / ns + kMlaTilePositions - 1) / kMlaTilePositions * kMlaTilePositions;
  return {chunk, (n + chunk - 1) / chunk};
}
inline constexpr size_t kMlaScratchBudget = size_t{128} << 20;  // per pass, float32 scratch

// Heads one latent-attention block takes: 16 per row group, up to 4 row groups.
int mla_heads_per_block(int heads);

struct MlaProblem {
  int tokens = 0;            // T of the call
  int heads = 0;             // query heads (the rank's)
  int latent = 0;            // kv_lora_rank R
  int v_dim = 0;             // value head dim (the output absorption's columns)
  int lora_rank_stride = 0;  // ranks the LoRA scratch holds per (token, head); 0 = no kv_b LoRA
  int max_positions = 0;     // the context bound: the longest a token of this grid may attend to
  int num_sms = 132;
  int max_chunk_tokens = 0;  // > 0: at most this many tokens per pass (tests)
};

struct MlaPlan {
  int chunk_tokens = 0;     // tokens per pass (the last pass may take fewer)
  int splits = 1;           // KV splits per (token, head group) in the grid (mla_token_split: how many a token uses)
  int query_cols = 128;     // output columns per query-absorption block: 32 or 128
  int output_cols = 128;    // output columns per output-absorption block: 32 or 128
  // Scratch of one pass, each part 256-byte aligned, laid out in this order.
  size_t latent_bytes = 0;   // [chunk][heads][R] f32: the absorbed query, then the latent output
  size_t partial_bytes = 0;  // splits > 1: [chunk][heads][splits][R] f32 unnormalised outputs
  size_t stats_bytes = 0;    // splits > 1: [chunk][heads][splits][2] f32 (running max, sum)
  size_t lora_bytes = 0;     // [chunk][heads][lora_rank_stride] f32: A o per (token, head)
  size_t scratch_bytes() const { return latent_bytes + partial_bytes + stats_bytes + lora_bytes; }
};

// tokens >= 1, heads >= 1, latent >= 1, max_positions >= 1.
MlaPlan choose_mla_plan(const MlaProblem& p);

// Device bytes of the bf16 kv_b copies absorbed MLA makes for its kernels, over all `layers`:
// W_UK [heads, nope, R] and W_UV^T [heads, R, v_dim] per layer, each its own cudaMalloc (256-byte
// granules). CudaBackend::derived_weight_bytes reports it so the loader counts it.
size_t mla_absorbed_weight_bytes(int layers, int heads, int nope, int v_dim, int latent);

}  // namespace moelora::cuda_plan
