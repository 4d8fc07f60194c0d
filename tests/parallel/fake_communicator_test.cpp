// The thread-based communicator: sums in rank order (reproducible, identical on every rank),
// gathers in rank order, barriers, and many collectives in a row without tearing.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include "tests/parallel/test_ranks.h"

namespace moelora {
namespace {

using testing_parallel::run_ranks;

// Values whose float32 sum depends on the order: (1e8 + 1) - 1e8 + ... loses the 1s unless the
// order is exactly rank 0, 1, 2, 3.
TEST(FakeCommunicator, AllReduceSumsInRankOrderIdenticallyOnEveryRank) {
  const int n = 4;
  const float contrib[n][3] = {{1e8f, 0.5f, 1.0f}, {1.0f, 0.25f, 2.0f}, {-1e8f, 0.125f, 3.0f}, {1.0f, 1e-8f, 4.0f}};
  float expected[3];
  for (int i = 0; i < 3; ++i) {
    float s = contrib[0][i];
    for (int r = 1; r < n; ++r) s += contrib[r][i];
    expected[i] = s;
  }
  std::vector<std::vector<float>> got(n);
  run_ranks(n, [&](int r, Communicator& comm) {
    EXPECT_EQ(comm.rank(), r);
    EXPECT_EQ(comm.size(), n);
    got[r].assign(contrib[r], contrib[r] + 3);
    comm.all_reduce_sum(got[r].data(), 3);
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(std::memcmp(got[r].data(), expected, sizeof(expected)), 0) << "rank " << r;
  EXPECT_EQ(expected[0], 1.0f);  // (1e8 + 1) - 1e8 + 1 in float32: the first 1 is lost
}

TEST(FakeCommunicator, AllGatherPlacesEachRanksBufferAtItsRank) {
  const int n = 3, count = 5;
  std::vector<std::vector<float>> got(n, std::vector<float>(n * count));
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<float> send(count);
    for (int i = 0; i < count; ++i) send[i] = static_cast<float>(100 * r + i);
    comm.all_gather(send.data(), count, got[r].data());
  });
  for (int r = 0; r < n; ++r)
    for (int src = 0; src < n; ++src)
      for (int i = 0; i < count; ++i) EXPECT_EQ(got[r][src * count + i], static_cast<float>(100 * src + i));
}

// Hundreds of collectives of different kinds back to back: a rank that ran ahead must never
// overwrite a buffer another rank is still reading.
TEST(FakeCommunicator, ManyCollectivesInARowStayConsistent) {
  const int n = 4, rounds = 300;
  std::atomic<int> barrier_count{0};
  std::vector<int> failures(n, 0);
  run_ranks(n, [&](int r, Communicator& comm) {
    std::vector<float> buf(7), all(n * 7);
    for (int round = 0; round < rounds; ++round) {
      for (int i = 0; i < 7; ++i) buf[i] = static_cast<float>(r + round + i);
      comm.all_reduce_sum(buf.data(), buf.size());
      for (int i = 0; i < 7; ++i) failures[r] += buf[i] != static_cast<float>(n * (round + i) + n * (n - 1) / 2);
      comm.all_gather(buf.data(), buf.size(), all.data());
      for (int i = 0; i < n * 7; ++i) failures[r] += all[i] != buf[i % 7];
      if (round % 50 == 0) {
        barrier_count++;
        comm.barrier();
        failures[r] += barrier_count.load() < (round / 50 + 1) * n;  // everyone arrived before anyone left
        comm.barrier();
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[r], 0) << "rank " << r;
}

TEST(FakeCommunicator, AGroupOfOneIsTheIdentity) {
  run_ranks(1, [](int, Communicator& comm) {
    float v[2] = {1.5f, -2.0f}, g[2];
    comm.all_reduce_sum(v, 2);
    comm.all_gather(v, 2, g);
    comm.barrier();
    EXPECT_EQ(v[0], 1.5f);
    EXPECT_EQ(g[1], -2.0f);
  });
}

}  // namespace
}  // namespace moelora
