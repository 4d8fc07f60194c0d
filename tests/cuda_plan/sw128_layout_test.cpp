// The 128-byte swizzle (cuda_plan/sw128_layout.h): what the kernels write is what their wgmma
// descriptors read. The K-major case is the layout the MoE token tile has run on the H200 since
// 2026-12-04; the attention prefill (attention_prefill_wgmma.cu) writes its K and V tiles with the
// same placement and reads V N-major.
#include <gtest/gtest.h>

#include <set>

#include "backends/cuda_plan/sw128_layout.h"

namespace moelora::cuda_plan {
namespace {

// The placement written out the way the MoE kernel's comment states it: piece q of row r goes to
// column q / 8 at row r, 16-byte unit (q % 8) ^ (r % 8).
int stated_piece_offset(int rows, int r, int q) { return (q >> 3) * rows * 128 + r * 128 + (((q & 7) ^ (r & 7)) << 4); }

// Byte of value d of row r in a tile of `rows` rows as the kernels write it.
int written(int rows, int r, int d) { return sw128_piece_offset(rows, r, d / 8) + (d % 8) * 2; }

TEST(Sw128Layout, PlacementIsThePermutationTheKernelsState) {
  for (int rows : {8, 16, 32, 64})
    for (int D : {64, 128, 192}) {
      std::set<int> seen;
      for (int r = 0; r < rows; ++r)
        for (int q = 0; q < D / 8; ++q) {
          const int o = sw128_piece_offset(rows, r, q);
          ASSERT_EQ(o, stated_piece_offset(rows, r, q)) << rows << " " << r << " " << q;
          ASSERT_EQ(o % 16, 0);
          ASSERT_TRUE(seen.insert(o).second) << "two pieces at byte " << o;
          ASSERT_LT(o, rows * D * 2);
        }
    }
}

TEST(Sw128Layout, KMajorDescriptorsReadTheWrittenTile) {
  // S = Q K^T: B = the K tile (rows = positions, values = head dims); k16 step s starts at
  // column s / 4, byte 32 (s % 4) of the row, stride byte offset 1024.
  for (int D : {64, 128, 192})
    for (int rows : {8, 16, 32, 64})
      for (int s = 0; s < D / 16; ++s) {
        const int start = (s / 4) * rows * 128 + (s % 4) * 32;
        for (int n = 0; n < rows; ++n)
          for (int k = 0; k < 16; ++k)
            ASSERT_EQ(sw128_kmajor_read(start, kSw128AtomBytes, n, k), written(rows, n, 16 * s + k))
                << "D " << D << " rows " << rows << " step " << s << " row " << n << " k " << k;
      }
}

TEST(Sw128Layout, MnMajorDescriptorsReadTheWrittenTileTransposed) {
  // P V: B = the V tile read N-major (k = position, n = head dim); 64 positions a tile, k16 step kk
  // starts 16 rows (2048 bytes) further, one 64-wide column of V per wgmma (leading byte offset =
  // a column's bytes, also right when N spans several columns).
  constexpr int rows = 64, col_bytes = rows * 128;
  for (int DV : {64, 128})
    for (int kk = 0; kk < rows / 16; ++kk) {
      for (int c = 0; c < DV / 64; ++c) {
        const int start = c * col_bytes + kk * 16 * 128;
        ASSERT_EQ(start % kSw128AtomBytes, 0) << "a descriptor's start must keep the atom phase";
        for (int k = 0; k < 16; ++k)
          for (int n = 0; n < 64; ++n)
            ASSERT_EQ(sw128_mnmajor_read(start, col_bytes, kSw128AtomBytes, k, n), written(rows, 16 * kk + k, 64 * c + n))
                << "DV " << DV << " step " << kk << " column " << c << " k " << k << " n " << n;
      }
      // One descriptor spanning every column (N = DV) reads the same bytes through its leading byte offset.
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < DV; ++n)
          ASSERT_EQ(sw128_mnmajor_read(kk * 2048, col_bytes, kSw128AtomBytes, k, n), written(rows, 16 * kk + k, n));
    }
}

TEST(Sw128Layout, AWrongStrideOrStepIsSeen) {
  // The checks above can fail: a 128-byte k-group stride or a 1024-byte step misreads the tile.
  constexpr int rows = 64, col_bytes = rows * 128;
  int wrong_sbo = 0, wrong_step = 0;
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 64; ++n) {
      wrong_sbo += sw128_mnmajor_read(2048, col_bytes, 128, k, n) != written(rows, 16 + k, n);
      wrong_step += sw128_mnmajor_read(1024, col_bytes, kSw128AtomBytes, k, n) != written(rows, 16 + k, n);
    }
  EXPECT_GT(wrong_sbo, 0);
  EXPECT_GT(wrong_step, 0);
}

}  // namespace
}  // namespace moelora::cuda_plan
