// moe_align's groupings checked structurally (exact): every valid pair sits in exactly one base
// tile of its expert; every pair sits in exactly one LoRA tile of its (slot, expert) or in the
// "none" group when its slot, expert or ranks disqualify it; gate_up shrink tiles cover the
// per-expert-A pairs and, once per token, the shared-A tokens; no tile exceeds its rows.
#include <algorithm>
#include <string>
#include <vector>

#include "backends/cuda/kernels/moe_align.cuh"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

struct AlignCase {
  int T, E, k, slots, tile_rows;
  std::string name() const {
    return "MOE_ALIGN(T=" + std::to_string(T) + ",E=" + std::to_string(E) + ",k=" + std::to_string(k) +
           ",slots=" + std::to_string(slots) + ",rows=" + std::to_string(tile_rows) + ")";
  }
};

class MoeAlign : public ::testing::TestWithParam<AlignCase> {};

TEST_P(MoeAlign, Groupings) {
  MOELORA_REQUIRE_GPU();
  const AlignCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int P = c.T * c.k, S = c.slots, E = c.E;
  std::vector<int32_t> ids(P), slot(c.T), gu_rank(S), d_rank(S);
  std::vector<int64_t> gu_stride(S);
  for (auto& e : ids) {
    const int r = rng.integer(0, 19);
    e = r == 0 ? -1 : r == 1 ? E : rng.integer(0, E - 1);  // sentinels mixed in
  }
  for (auto& s : slot) s = rng.integer(-2, S);  // -2, -1 and S are all "no adapter"
  for (int s = 0; s < S; ++s) {
    gu_rank[s] = s % 4 == 3 ? 0 : 16;
    d_rank[s] = s % 5 == 4 ? 0 : 8;
    gu_stride[s] = s % 3 == 0 ? 0 : 16 * 1024;  // every third slot shares its gate_up A
  }
  DeviceArray<int32_t> d_ids(ids), d_slot(slot), d_gr(gu_rank), d_dr(d_rank), counters(cuda::kMoeNumCounters);
  DeviceArray<int64_t> d_gs(gu_stride);
  const int max_tiles = cuda::moe_max_tiles(P, E, c.tile_rows);
  const int max_l = cuda::moe_max_tiles(P, S * E + 1, cuda::kMoeLoraTileRows);
  const int max_g = max_l + cuda::moe_max_tiles(c.T, S, cuda::kMoeLoraTileRows);
  DeviceArray<int32_t> sorted(P), l_sorted(P), t_sorted(c.T);
  DeviceArray<cuda::MoeTile> tiles(max_tiles), l_tiles(max_l), g_tiles(max_g);
  DeviceArray<int32_t> tile_pairs(static_cast<size_t>(max_tiles) * c.tile_rows);
  cuda::MoeAlignParams a;
  a.ids = d_ids.get();
  a.T = c.T;
  a.k = c.k;
  a.E = E;
  a.tile_rows = c.tile_rows;
  a.sorted = sorted.get();
  a.tile_pairs = tile_pairs.get();
  a.tiles = tiles.get();
  a.max_tiles = max_tiles;
  a.counters = counters.get();
  a.token_slot = d_slot.get();
  a.num_slots = S;
  a.gu_rank = d_gr.get();
  a.d_rank = d_dr.get();
  a.gu_a_stride = d_gs.get();
  a.l_sorted = l_sorted.get();
  a.l_tiles = l_tiles.get();
  a.max_l_tiles = max_l;
  a.t_sorted = t_sorted.get();
  a.g_tiles = g_tiles.get();
  a.max_g_tiles = max_g;
  cuda::moe_align(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto cnt = counters.download();
  const auto ts = tiles.download(), ls = l_tiles.download(), gs = g_tiles.download();
  const auto srt = sorted.download(), lsrt = l_sorted.download(), tsrt = t_sorted.download();

  // Base tiles.
  std::vector<int> seen(P, 0);
  ASSERT_LE(cnt[cuda::kMoeCntTiles], max_tiles);
  for (int i = 0; i < cnt[cuda::kMoeCntTiles]; ++i) {
    const auto& t = ts[i];
    ASSERT_TRUE(t.count >= 1 && t.count <= c.tile_rows && t.start >= 0 && t.start + t.count <= P) << "tile " << i;
    for (int m = 0; m < t.count; ++m) {
      const int p = srt[t.start + m];
      ASSERT_TRUE(p >= 0 && p < P);
      EXPECT_EQ(ids[p], t.expert) << "pair " << p << " in a tile of another expert";
      ++seen[p];
    }
  }
  for (int p = 0; p < P; ++p) EXPECT_EQ(seen[p], (ids[p] >= 0 && ids[p] < E) ? 1 : 0) << "pair " << p;
  // tile_pairs: row m of tile i is the tile's m-th sorted pair, -1 past its count.
  const auto tp = tile_pairs.download();
  for (int i = 0; i < cnt[cuda::kMoeCntTiles]; ++i)
    for (int m = 0; m < c.tile_rows; ++m)
      EXPECT_EQ(tp[static_cast<size_t>(i) * c.tile_rows + m], m < ts[i].count ? srt[ts[i].start + m] : -1)
          << "tile " << i << " row " << m;

  // LoRA tiles.
  auto valid_lora = [&](int p) {
    const int s = slot[p / c.k], e = ids[p];
    return s >= 0 && s < S && e >= 0 && e < E && (gu_rank[s] > 0 || d_rank[s] > 0);
  };
  std::vector<int> lseen(P, 0), gseen(P, 0), tseen(c.T, 0);
  ASSERT_LE(cnt[cuda::kMoeCntLoraTiles], max_l);
  for (int i = 0; i < cnt[cuda::kMoeCntLoraTiles]; ++i) {
    const auto& t = ls[i];
    ASSERT_TRUE(t.count >= 1 && t.count <= cuda::kMoeLoraTileRows && t.start + t.count <= P);
    for (int m = 0; m < t.count; ++m) {
      const int p = lsrt[t.start + m];
      ASSERT_TRUE(p >= 0 && p < P);
      ++lseen[p];
      if (t.slot < 0) {
        EXPECT_FALSE(valid_lora(p)) << "LoRA pair " << p << " in the none group";
      } else {
        EXPECT_TRUE(valid_lora(p) && slot[p / c.k] == t.slot && ids[p] == t.expert) << "pair " << p;
      }
    }
  }
  for (int p = 0; p < P; ++p) EXPECT_EQ(lseen[p], 1) << "LoRA pair " << p;
  ASSERT_LE(cnt[cuda::kMoeCntLoraGuTiles], max_g);
  for (int i = 0; i < cnt[cuda::kMoeCntLoraGuTiles]; ++i) {
    const auto& t = gs[i];
    ASSERT_TRUE(t.slot >= 0 && t.slot < S && gu_rank[t.slot] > 0 && t.count >= 1 && t.count <= cuda::kMoeLoraTileRows);
    for (int m = 0; m < t.count; ++m) {
      if (t.expert < 0) {
        const int tok = tsrt[t.start + m];
        ASSERT_TRUE(tok >= 0 && tok < c.T);
        EXPECT_EQ(slot[tok], t.slot);
        EXPECT_EQ(gu_stride[t.slot], 0);
        ++tseen[tok];
      } else {
        const int p = lsrt[t.start + m];
        EXPECT_TRUE(valid_lora(p) && slot[p / c.k] == t.slot && ids[p] == t.expert && gu_stride[t.slot] != 0);
        ++gseen[p];
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const int s = slot[p / c.k];
    const bool want = valid_lora(p) && gu_rank[s] > 0 && gu_stride[s] != 0;
    EXPECT_EQ(gseen[p], want ? 1 : 0) << "gate_up shrink pair " << p;
  }
  for (int t = 0; t < c.T; ++t) {
    const int s = slot[t];
    const bool want = s >= 0 && s < S && gu_rank[s] > 0 && gu_stride[s] == 0;
    EXPECT_EQ(tseen[t], want ? 1 : 0) << "shared-A token " << t;
  }
}

std::string align_name(const ::testing::TestParamInfo<AlignCase>& i) {
  return gtest_safe(i.param.name(), /*trim_trailing=*/false);
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeAlign,
                         ::testing::Values(AlignCase{1, 8, 2, 2, 8}, AlignCase{37, 8, 2, 5, 16},
                                           AlignCase{256, 128, 8, 8, 8}, AlignCase{256, 256, 8, 32, 32},
                                           AlignCase{3000, 128, 8, 4, 64}),
                         align_name);
INSTANTIATE_TEST_SUITE_P(MoeSanitize, MoeAlign, ::testing::Values(AlignCase{37, 8, 2, 5, 16}), align_name);

}  // namespace
}  // namespace moelora::ops_test
