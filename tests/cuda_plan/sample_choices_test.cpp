#include "backends/cuda_plan/sample_choices.h"

#include <gtest/gtest.h>

namespace moelora::cuda_plan {
namespace {

// Resident clusters of 2/4/8/16 blocks of the sampling kernel on the H200 (dev/sampling.cu run 3
// printed 132 62 30 14: two 512-thread blocks per SM).
constexpr std::array<int, 5> kH200{0, 132, 62, 30, 14};

// The measured best of run 3 (peaked logits, top-p 0.9; us): 1 row 16 blocks (135; 8: 210),
// 8 rows 16 (248; 8: 282), 64 rows 8 (989; 2: 1057), 128 rows 2 (1673), 256 rows 2 (3229).
TEST(SampleCluster, PicksTheMeasuredBest) {
  EXPECT_EQ(choose_sample_cluster(1, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(8, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(64, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(128, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(256, kH200), 2);
}

TEST(SampleCluster, CostIsWavesTimesRowTime) {
  EXPECT_EQ(choose_sample_cluster(14, kH200), 16);  // one wave of 16
  EXPECT_EQ(choose_sample_cluster(29, kH200), 8);   // 3 x 135 > 1 x 210
  EXPECT_EQ(choose_sample_cluster(32, kH200), 4);   // 1 x 391 < 2 x 210 (measured: 8 was faster)
  EXPECT_EQ(choose_sample_cluster(124, kH200), 2);  // 1 x 753 < 2 x 391 < 5 x 210
}

TEST(SampleCluster, SizesThatCannotRunAreSkipped) {
  EXPECT_EQ(choose_sample_cluster(1, {0, 132, 62, 30, 0}), 8);  // no 16-block clusters on this GPU
  EXPECT_EQ(choose_sample_cluster(4, {0, 0, 0, 0, 0}), 2);
  EXPECT_EQ(choose_sample_cluster(1000, {0, 66, 0, 0, 0}), 2);
}

}  // namespace
}  // namespace moelora::cuda_plan
