#include "backends/cuda_plan/sample_choices.h"

#include <gtest/gtest.h>

namespace moelora::cuda_plan {
namespace {

// Resident clusters of 2/4/8/16 blocks of the sampling kernel on the H200 (dev/sampling.cu run 2
// printed 66 30 15 7: one 512-thread block per SM).
constexpr std::array<int, 5> kH200{0, 66, 30, 15, 7};

// The measured best of run 2 (peaked logits, top-p 0.9; us): 1 row 16 blocks (132; 8: 207),
// 8 rows 8 (273; 16: 319), 32 rows 8 (684; 16: 793), 64 rows 2 (1010; 8: 1275), 128 rows 2
// (1979), 256 rows 2 (4001).
TEST(SampleCluster, PicksTheMeasuredBest) {
  EXPECT_EQ(choose_sample_cluster(1, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(8, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(32, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(64, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(128, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(256, kH200), 2);
}

TEST(SampleCluster, CostIsWavesTimesRowTime) {
  EXPECT_EQ(choose_sample_cluster(7, kH200), 16);   // one wave of 16
  EXPECT_EQ(choose_sample_cluster(15, kH200), 8);   // 3 x 132 > 1 x 207
  EXPECT_EQ(choose_sample_cluster(30, kH200), 4);   // 1 x 388 < 2 x 207
  EXPECT_EQ(choose_sample_cluster(46, kH200), 2);   // 4 x 207 > 1 x 748
}

TEST(SampleCluster, SizesThatCannotRunAreSkipped) {
  EXPECT_EQ(choose_sample_cluster(1, {0, 66, 30, 15, 0}), 8);  // no 16-block clusters on this GPU
  EXPECT_EQ(choose_sample_cluster(4, {0, 0, 0, 0, 0}), 2);
  EXPECT_EQ(choose_sample_cluster(1000, {0, 66, 0, 0, 0}), 2);
}

}  // namespace
}  // namespace moelora::cuda_plan
