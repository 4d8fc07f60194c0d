// The dense projection's and decode attention's kernel choices, checked without a GPU against
// values worked out by hand from the rules their comments cite.
#include <gtest/gtest.h>

#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda_plan {
namespace {

TEST(DenseChoices, SmallMKernelUpTo32TokensWithFp8WeightsAnd8WithBf16) {
  EXPECT_EQ(choose_dense_path(1, DenseWeights::kFp8), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(32, DenseWeights::kFp8), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(33, DenseWeights::kFp8), DensePath::kCublasLt);
  EXPECT_EQ(choose_dense_path(8, DenseWeights::kBf16), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(9, DenseWeights::kBf16), DensePath::kCublasLt);
}

TEST(DenseChoices, Nvfp4DequantisesInBoundedRowChunks) {
  // DeepSeek-V3 dense gate|up [36864, 7168]: 4680 rows (64 MiB of bf16) per pass, a multiple of 8.
  EXPECT_EQ(nvfp4_dequant_chunk_rows(36864, 7168), 4680);
  EXPECT_LE(int64_t{4680} * 7168 * 2, kNvfp4DequantChunkBytes);
  EXPECT_EQ(nvfp4_dequant_chunk_rows(512, 2048), 512);  // small weights in one pass
  EXPECT_EQ(nvfp4_dequant_chunk_rows(100, 1 << 30), 8);  // at least 8 rows
}

TEST(DenseChoices, Nvfp4KeepsEveryDecodeBatchOnThe4BitKernel) {
  // Up to the largest captured decode batch; prefill chunks dequantise into scratch for cuBLASLt.
  EXPECT_EQ(choose_dense_path(1, DenseWeights::kNvfp4), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(256, DenseWeights::kNvfp4), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(257, DenseWeights::kNvfp4), DensePath::kCublasLt);
}

TEST(DenseChoices, SmallMTilingCoversMWithFewestTokenTilesAndSplitsKOver8Warps) {
  DenseSmallMTiling t = choose_dense_small_m_tiling(1, 2048);
  EXPECT_EQ(t.m_tiles, 1);
  EXPECT_EQ(t.row_groups, 1);
  EXPECT_EQ(t.k_warps, 8);
  EXPECT_EQ(choose_dense_small_m_tiling(9, 2048).m_tiles, 2);
  EXPECT_EQ(choose_dense_small_m_tiling(17, 2048).m_tiles, 4);   // 3 tiles of 8 -> 4
  EXPECT_EQ(choose_dense_small_m_tiling(33, 2048).m_tiles, 8);
  EXPECT_EQ(choose_dense_small_m_tiling(500, 2048).m_tiles, 8);  // further tokens: more grid rows
  EXPECT_EQ(choose_dense_small_m_tiling(4, 256).k_warps, 2);     // only two 128-wide K chunks
  const DenseSmallMTiling forced = choose_dense_small_m_tiling(4, 4096, /*row_groups=*/2, /*k_warps=*/0);
  EXPECT_EQ(forced.row_groups, 2);
  EXPECT_EQ(forced.k_warps, 4);  // 8 warps in all
  EXPECT_EQ(choose_dense_small_m_tiling(4, 4096, 4, 2).k_warps, 2);
}

TEST(AttentionChoices, DecodeSplitsFillTheGpuTwiceWithoutChunksUnder128Positions) {
  // One token, 4 KV heads of 8 query heads on 132 SMs: 4 blocks per split, 66 wanted splits; 4096
  // positions hold at most 32 splits of 128.
  AttentionDecodeSplit s = choose_attention_decode_split(1, 4, 8, 4096, 132, 128, 128);
  EXPECT_EQ(s.max_splits, 32);
  // 256 tokens already fill the GPU: one split of the whole context.
  s = choose_attention_decode_split(256, 4, 8, 4000, 132, 128, 128);
  EXPECT_EQ(s.max_splits, 1);
  // A short context never splits below 128 positions.
  s = choose_attention_decode_split(1, 4, 8, 100, 132, 128, 128);
  EXPECT_EQ(s.max_splits, 1);
  // 16 query heads per block: 32 query heads per KV head count twice.
  s = choose_attention_decode_split(8, 4, 32, 8192, 132, 128, 128);  // 64 blocks per split -> 5 wanted
  EXPECT_EQ(s.max_splits, 5);
}

TEST(AttentionChoices, PipelineDepthFollowsTheMeasuredWaveQuantisation) {
  // Qwen3-30B-A3B heads (4 KV heads of 8 query heads x 128) on the H200, bench/RESULTS.md decode
  // attention 2026-12-04: 2 stages (3 blocks per SM) won at 384 blocks (32 tokens, 3 splits) and
  // 1024 blocks (256 tokens), 3 stages (2 per SM) at 512 blocks (128 tokens; 64 tokens x 2 splits).
  EXPECT_EQ(attention_decode_smem_bytes(128, 128, 8, 2), 69632);
  EXPECT_EQ(attention_decode_smem_bytes(128, 128, 8, 3), 104448);
  EXPECT_EQ(choose_attention_decode_split(32, 4, 8, 4096, 132, 128, 128).stages, 2);
  EXPECT_EQ(choose_attention_decode_split(256, 4, 8, 4096, 132, 128, 128).stages, 2);
  EXPECT_EQ(choose_attention_decode_split(128, 4, 8, 4096, 132, 128, 128).stages, 3);
  const AttentionDecodeSplit s64 = choose_attention_decode_split(64, 4, 8, 4096, 132, 128, 128);
  EXPECT_EQ(s64.max_splits, 2);
  EXPECT_EQ(s64.stages, 3);
  // A few blocks: every depth fits them at once; the shallower one.
  EXPECT_EQ(choose_attention_decode_split(1, 4, 8, 512, 132, 128, 128).stages, 2);
  // 16 query heads of 32 values: 2 stages x 4 warps x 16 positions x (40 + 40) bf16.
  EXPECT_EQ(attention_decode_smem_bytes(32, 32, 16, 2), 20480);
}

TEST(AttentionChoices, EveryTokenSplitIsNonEmptyAndCoversItsPositions) {
  // Whatever the grid's extent, a token's splits are whole 64-position pieces of at least 128
  // positions (except a shorter context's only split), none empty, together exactly its positions.
  for (int max_splits : {1, 2, 3, 5, 32, 66, 128})
    for (int n = 1; n <= 20000; n += (n < 1200 ? 1 : 97)) {
      const AttentionTokenSplit t = attention_token_split(n, max_splits);
      ASSERT_GE(t.count, 1);
      ASSERT_LE(t.count, max_splits);
      ASSERT_EQ(t.chunk % 64, 0);
      ASSERT_TRUE(t.count == 1 || t.chunk >= kAttentionMinSplitPositions) << n << " " << max_splits;
      ASSERT_LT((t.count - 1) * t.chunk, n) << n << " " << max_splits;
      ASSERT_GE(t.count * t.chunk, n);
    }
  // A graph sized for 16k positions still spreads a 512-position context over 4 splits.
  const AttentionTokenSplit t = attention_token_split(512, choose_attention_decode_split(1, 4, 8, 16384, 132, 128, 128).max_splits);
  EXPECT_EQ(t.count, 4);
  EXPECT_EQ(t.chunk, 128);
}

}  // namespace

TEST(AttentionChoices, WgmmaPrefillExactlyWhereItIsBuilt) {
  // Built exactly for the tensor-core head dims that are multiples of 64 (its 64-wide swizzle columns).
  int built = 0;
  for (int k = 8; k <= 256; k += 8)
    for (int v = 8; v <= 256; v += 8) {
      const bool b = attention_prefill_wgmma_built(k, v);
      if (b) ++built;
      EXPECT_EQ(b, k % 64 == 0 && v % 64 == 0 && choose_attention_kernel(k, v) == AttentionKernel::kTensorCore) << k << "/" << v;
      // Chosen wherever it is built (measured faster there), never elsewhere.
      const AttentionPrefillKernel c = choose_attention_prefill(k, v);
      EXPECT_EQ(c == AttentionPrefillKernel::kWgmma, b) << k << "/" << v;
    }
  EXPECT_EQ(built, 3);  // 64/64, 128/128 (Qwen3, Mixtral), 192/128 (DeepSeek's decompressed MLA)
  EXPECT_TRUE(attention_prefill_wgmma_built(128, 128));
  EXPECT_TRUE(attention_prefill_wgmma_built(192, 128));
  EXPECT_FALSE(attention_prefill_wgmma_built(48, 32));
  EXPECT_EQ(attention_prefill_rows(AttentionPrefillKernel::kWgmma), 128);
  EXPECT_EQ(attention_prefill_rows(AttentionPrefillKernel::kMmaSync), 64);
}

}  // namespace moelora::cuda_plan
