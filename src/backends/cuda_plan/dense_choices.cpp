#include "backends/cuda_plan/dense_choices.h"

#include <algorithm>
#include <cstdint>

namespace moelora::cuda_plan {

namespace {
// Where our small-M kernel stops winning (dev/dense_gemm.cu on the H200, bench/RESULTS.md): FP8
// weights are read at half the bytes of bf16 and cuBLASLt adds an activation-quantisation pass,
// so our kernel wins longer for FP8.
constexpr int kFp8SmallMMax = 32;
constexpr int kBf16SmallMMax = 8;
constexpr int kSmallMDesignMax = 64;  // one grid row of 8 token tiles (dense_gemm.cuh)
constexpr int kKBlock = 128;          // K chunk of the small-M kernel
constexpr int kMaxWarps = 8;
}  // namespace

DensePath choose_dense_path(int M, bool fp8_weights) {
  return M <= (fp8_weights ? kFp8SmallMMax : kBf16SmallMMax) ? DensePath::kSmallM : DensePath::kCublasLt;
}

DenseSmallMTiling choose_dense_small_m_tiling(int M, int in, int row_groups, int k_warps) {
  DenseSmallMTiling t;
  // Token tiles of 8: as few as cover M (up to 8 tiles = 64 tokens per grid row).
  const int m8 = (std::min(std::max(M, 1), kSmallMDesignMax) + 7) / 8;
  t.m_tiles = m8 <= 1 ? 1 : m8 <= 2 ? 2 : m8 <= 4 ? 4 : 8;
  // Measured on the H200 (bench/RESULTS.md, dense small-M tilings): one 16-row group per block
  // with 8 warps splitting K was the fastest tiling at every M up to 64, so it is the default;
  // fewer K warps only when K has fewer 128-wide chunks than that.
  t.row_groups = row_groups > 0 ? row_groups : 1;
  const int kblocks = (std::max(in, 1) + kKBlock - 1) / kKBlock;
  t.k_warps = k_warps > 0 ? k_warps : std::max(1, std::min(kMaxWarps / t.row_groups, kblocks));
  return t;
}

AttentionDecodeSplit choose_attention_decode_split(int T, int kv_heads, int group, int max_positions, int num_sms) {
  // Enough blocks to fill the GPU about twice (a block works on 16 query heads of one KV head for
  // one token), but never splits under 128 positions. The factor 2 is a compromise the H200 runs
  // bear out only roughly (bench/RESULTS.md, paged decode attention: a 66-SM plan won at B = 32, a
  // 264-block one at B = 8 with a 16k context).
  const int64_t per_split = static_cast<int64_t>(std::max(T, 1)) * kv_heads * ((group + 15) / 16);
  const int want = static_cast<int>(std::max<int64_t>(1, (2 * static_cast<int64_t>(num_sms) + per_split - 1) / per_split));
  int chunk = (std::max(1, max_positions) + want - 1) / want;
  chunk = std::max(128, (chunk + 63) / 64 * 64);
  AttentionDecodeSplit s;
  s.chunk = chunk;
  s.max_splits = std::max(1, (max_positions + chunk - 1) / chunk);
  return s;
}

}  // namespace moelora::cuda_plan
