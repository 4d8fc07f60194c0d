#include "backends/cuda_plan/sample_choices.h"

#include <gtest/gtest.h>

namespace moelora::cuda_plan {
namespace {

// Resident clusters of 2/4/8/16 blocks of the sampling kernel on the H200 (dev/sampling.cu printed
// 132 62 30 14: two 512-thread blocks per SM).
constexpr std::array<int, 5> kH200{0, 132, 62, 30, 14};

// The measured best of the 2026-12-06 H200 run (peaked logits, top-p 0.9; us): 1 row 16 blocks
// (47.6; 8: 61.2), 8 rows 16 (71.8; 8: 72.7), 64 rows 2 (209.2; 8: 233.7), 128 rows 2 (297.7; 4:
// 373.2), 256 rows 2 (568.8; 4: 655.6).
TEST(SampleCluster, PicksTheMeasuredBest) {
  EXPECT_EQ(choose_sample_cluster(1, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(8, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(64, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(128, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(256, kH200), 2);
}

TEST(SampleCluster, CostIsWavesOfPartlyFilledTime) {
  // One row alone and a full wave are the model's two measured points.
  EXPECT_DOUBLE_EQ(sample_batch_us(1, 1, 132), 183.4);
  EXPECT_DOUBLE_EQ(sample_batch_us(132, 1, 132), 287.6);
  EXPECT_DOUBLE_EQ(sample_batch_us(264, 1, 132), 2 * 287.6);
  // A partial wave lies between them, linearly in its rows.
  EXPECT_NEAR(sample_batch_us(66, 1, 132), 183.4 + (287.6 - 183.4) * 65.0 / 131.0, 1e-9);
  EXPECT_NEAR(sample_batch_us(15, 4, 14), 67.3 + 47.6, 1e-9);
  // Hence: 14 rows fill one wave of 16 blocks (67.3 < 8's 61.2 + 24.5 x 13 / 29 = 72.2); at 32
  // rows 4 blocks (one wave, 119.9) beats 8 (1 full wave + 2 rows, 147.7).
  EXPECT_EQ(choose_sample_cluster(14, kH200), 16);
  EXPECT_EQ(choose_sample_cluster(32, kH200), 4);
}

TEST(SampleCluster, SizesThatCannotRunAreSkipped) {
  EXPECT_EQ(choose_sample_cluster(1, {0, 132, 62, 30, 0}), 8);  // no 16-block clusters on this GPU
  EXPECT_EQ(choose_sample_cluster(4, {0, 0, 0, 0, 0}), 2);
  EXPECT_EQ(choose_sample_cluster(1000, {0, 66, 0, 0, 0}), 2);
}

}  // namespace
}  // namespace moelora::cuda_plan
