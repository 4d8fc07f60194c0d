#include "backends/cuda_plan/dense_choices.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace moelora::cuda_plan {

namespace {
// Where our small-M kernel stops winning (dev/dense_gemm.cu on the H200, bench/RESULTS.md): FP8
// weights are read at half the bytes of bf16 and cuBLASLt adds an activation-quantisation pass,
// so our kernel wins longer for FP8.
constexpr int kFp8SmallMMax = 32;
constexpr int kBf16SmallMMax = 8;
// NVFP4: not measured yet (no GPU when it was written). Our kernel reads a quarter of bf16's bytes
// and the alternative first writes and rereads the whole weight as bf16, so it keeps every decode
// batch up to the largest captured one (256 tokens: 4 grid rows, whose rereads of a projection's
// few MB of 4-bit weights hit L2); prefill chunks above that take the bf16 GEMM.
constexpr int kNvfp4SmallMMax = 256;
constexpr int kSmallMDesignMax = 64;  // one grid row of 8 token tiles (dense_gemm.cuh)
constexpr int kKBlock = 128;          // K chunk of the small-M kernel
constexpr int kMaxWarps = 8;
}  // namespace

DensePath choose_dense_path(int M, DenseWeights w) {
  const int small_max = w == DenseWeights::kFp8 ? kFp8SmallMMax : w == DenseWeights::kNvfp4 ? kNvfp4SmallMMax : kBf16SmallMMax;
  return M <= small_max ? DensePath::kSmallM : DensePath::kCublasLt;
}

int nvfp4_dequant_chunk_rows(int out, int in) {
  const int64_t fit = kNvfp4DequantChunkBytes / (2 * static_cast<int64_t>(std::max(in, 1))) / 8 * 8;
  return static_cast<int>(std::min<int64_t>(std::max(out, 0), std::max<int64_t>(fit, 8)));
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

namespace {
// Hopper: 228 KB of shared memory per SM, 1 KB of it reserved per resident block.
constexpr int kSmemPerSm = 228 * 1024, kSmemPerBlockReserved = 1024;
constexpr int kMaxDecodeBlocksPerSm = 4;  // registers: ~120-200 per thread x 128 threads
}  // namespace

AttentionKernel choose_attention_kernel(int k, int v) {
  for (const HeadDims& d : kTensorCoreHeadDims)
    if (d.k == k && d.v == v) return AttentionKernel::kTensorCore;
  // attention_generic.cu: 16-byte loads of K rows (k % 8), one f32 accumulator per lane per 32 V
  // columns (v <= 256), the query in 1 KiB of shared memory per warp (k <= 256).
  if (k > 0 && k % 8 == 0 && k <= kGenericAttentionMaxDim && v > 0 && v <= kGenericAttentionMaxDim)
    return AttentionKernel::kGeneric;
  return AttentionKernel::kUnsupported;
}

bool attention_prefill_wgmma_built(int k, int v) {
  return k % 64 == 0 && v % 64 == 0 && choose_attention_kernel(k, v) == AttentionKernel::kTensorCore;
}

AttentionPrefillKernel choose_attention_prefill(int k, int v) {
  return attention_prefill_wgmma_built(k, v) ? AttentionPrefillKernel::kWgmma : AttentionPrefillKernel::kMmaSync;
}

AttentionDecodeSplit choose_attention_decode_split(int T, int kv_heads, int group, int max_positions, int num_sms,
                                                   int k_head_dim, int v_head_dim) {
  // Enough blocks to fill the GPU about twice, but no split under kAttentionMinSplitPositions.
  const int heads = attention_decode_heads_per_block(group);
  const int64_t per_split = static_cast<int64_t>(std::max(T, 1)) * kv_heads * ((group + heads - 1) / heads);
  const int want = static_cast<int>(std::max<int64_t>(1, (2 * static_cast<int64_t>(num_sms) + per_split - 1) / per_split));
  const int longest = (std::max(1, max_positions) + kAttentionMinSplitPositions - 1) / kAttentionMinSplitPositions;
  AttentionDecodeSplit s;
  s.max_splits = std::clamp(std::min(want, longest), 1, kAttentionMaxSplits);
  // Pipeline depth: 2 stages let 3 blocks share an SM at Qwen3's 128-value heads, 3 stages only 2.
  // Which wins is wave quantisation (bench/RESULTS.md, decode attention 2026-12-04: 384 blocks ran
  // 23 % faster at 2 stages (0.97 waves of 3 per SM against 1.45 of 2), 512 blocks 8-17 % faster at
  // 3 (1.94 waves against 1.29), 1024 blocks 6-10 % faster at 2). Model: a block's time grows with
  // the blocks sharing its SM, a partial wave costs a whole one while there are at most 2 waves and
  // blurs into a fraction beyond (blocks start as others end); the cheaper depth, ties to fewer stages.
  const int64_t blocks = per_split * s.max_splits;
  double best = 0.0;
  for (int stages = 2; stages <= 3; ++stages) {
    const int bytes = attention_decode_smem_bytes(k_head_dim, v_head_dim, heads, stages) + kSmemPerBlockReserved;
    const int per_sm = std::clamp(kSmemPerSm / bytes, 1, kMaxDecodeBlocksPerSm);
    const double waves = static_cast<double>(blocks) / (static_cast<double>(per_sm) * num_sms);
    const double effective = waves <= 2.0 ? std::ceil(waves) : waves;
    const int64_t sharing = std::min<int64_t>(per_sm, (blocks + num_sms - 1) / num_sms);
    const double cost = effective * static_cast<double>(sharing);
    if (stages == 2 || cost < best - 1e-9) {
      best = cost;
      s.stages = stages;
    }
  }
  return s;
}

}  // namespace moelora::cuda_plan
