// The dense projection's and decode attention's kernel choices, checked without a GPU against
// values worked out by hand from the rules their comments cite.
#include <gtest/gtest.h>

#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda_plan {
namespace {

TEST(DenseChoices, SmallMKernelUpTo32TokensWithFp8WeightsAnd8WithBf16) {
  EXPECT_EQ(choose_dense_path(1, true), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(32, true), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(33, true), DensePath::kCublasLt);
  EXPECT_EQ(choose_dense_path(8, false), DensePath::kSmallM);
  EXPECT_EQ(choose_dense_path(9, false), DensePath::kCublasLt);
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
  // positions / 66 = 63 -> the 128-position minimum -> 32 splits.
  AttentionDecodeSplit s = choose_attention_decode_split(1, 4, 8, 4096, 132);
  EXPECT_EQ(s.chunk, 128);
  EXPECT_EQ(s.max_splits, 32);
  // 256 tokens already fill the GPU: one split of the whole context (a multiple of 64).
  s = choose_attention_decode_split(256, 4, 8, 4000, 132);
  EXPECT_EQ(s.chunk, 4032);
  EXPECT_EQ(s.max_splits, 1);
  // A short context never splits below 128 positions.
  s = choose_attention_decode_split(1, 4, 8, 100, 132);
  EXPECT_EQ(s.max_splits, 1);
  // 16 query heads per block: 32 query heads per KV head count twice.
  s = choose_attention_decode_split(8, 4, 32, 8192, 132);  // 64 blocks per split -> 5 wanted
  EXPECT_EQ(s.chunk, 1664);                                // 8192 / 5 = 1639 -> 1664
  EXPECT_EQ(s.max_splits, 5);
}

}  // namespace
}  // namespace moelora::cuda_plan
