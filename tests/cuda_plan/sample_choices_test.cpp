#include "backends/cuda_plan/sample_choices.h"

#include <gtest/gtest.h>

namespace moelora::cuda_plan {
namespace {

// Resident clusters of 1/2/4/8 blocks of the sampling kernel on the H200 (dev/sampling.cu printed
// 132 66 30 15: one 512-thread block per SM); the kernel takes 2 blocks or more, 16 here unused.
constexpr std::array<int, 5> kH200{0, 66, 30, 15, 0};
constexpr std::array<int, 5> kWith16{0, 66, 30, 15, 7};

TEST(SampleCluster, FewRowsSpreadOverEightBlocks) {
  EXPECT_EQ(choose_sample_cluster(1, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(15, kH200), 8);
}

// The H200 workbench's best sizes (peaked logits, top-p 0.9): 32 rows 8 blocks (662 us; 2 blocks
// 948), 64 rows 2 (947; 8 blocks 1207), 128 rows 2 (1889; 1 block 1921), 256 rows 2 (3853; 1 block
// 4004).
TEST(SampleCluster, MeasuredBestSizes) {
  EXPECT_EQ(choose_sample_cluster(32, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(64, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(128, kH200), 2);
  EXPECT_EQ(choose_sample_cluster(256, kH200), 2);
}

TEST(SampleCluster, CostIsWavesOverBlocks) {
  // 16 rows: 8 blocks need 2 waves (cost 2/8), 4 blocks one (1/4): a tie, the larger size wins.
  EXPECT_EQ(choose_sample_cluster(16, kH200), 8);
  // 31 rows: 8 blocks 3 waves (3/8), 4 blocks 2 (2/4), 2 blocks 1 (1/2): 8.
  EXPECT_EQ(choose_sample_cluster(31, kH200), 8);
  // 40 rows: 8 blocks 3/8, 4 blocks 2/4, 2 blocks 1/2.
  EXPECT_EQ(choose_sample_cluster(40, kH200), 8);
  // 50 rows: 8 blocks 4/8, 2 blocks 1/2: a tie, 8.
  EXPECT_EQ(choose_sample_cluster(50, kH200), 8);
  EXPECT_EQ(choose_sample_cluster(61, kH200), 2);  // 8 blocks 5/8 > 2 blocks 1/2
}

TEST(SampleCluster, SixteenBlocksForTheFewestRows) {
  EXPECT_EQ(choose_sample_cluster(1, kWith16), 16);
  EXPECT_EQ(choose_sample_cluster(7, kWith16), 16);
  EXPECT_EQ(choose_sample_cluster(8, kWith16), 16);  // 2 waves of 16 (2/16) tie 1 wave of 8 (1/8): larger
  EXPECT_EQ(choose_sample_cluster(15, kWith16), 8);  // 3 waves of 16 (3/16) > 1 wave of 8 (1/8)
  EXPECT_EQ(choose_sample_cluster(200, kWith16), 8);  // 14 waves of 8 (14/8) < 4 waves of 2 (4/2)
  EXPECT_EQ(choose_sample_cluster(256, kWith16), 2);  // 18/8 > 4/2
}

TEST(SampleCluster, SizesThatCannotRunAreSkipped) {
  EXPECT_EQ(choose_sample_cluster(4, {0, 0, 0, 0, 0}), 1);
  EXPECT_EQ(choose_sample_cluster(4, {132, 66, 0, 0, 0}), 2);
  EXPECT_EQ(choose_sample_cluster(1000, {0, 66, 0, 0, 0}), 2);
}

}  // namespace
}  // namespace moelora::cuda_plan
