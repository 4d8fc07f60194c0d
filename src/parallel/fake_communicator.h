// N ranks as threads of one process sharing memory: the Communicator that the CPU tests and
// `moelora verify --tp/--ep` run on. Sums are formed in rank order 0..N-1 in float32 by every rank
// from the same inputs, so results are reproducible run to run and identical on all ranks (the
// property NCCL's all-reduce also gives within one run).
#pragma once

#include <barrier>
#include <memory>
#include <mutex>
#include <vector>

#include "parallel/communicator.h"

namespace moelora {

// Shared state of one group. Create it once, hand communicator(r) to the thread of rank r.
class FakeCommGroup {
 public:
  explicit FakeCommGroup(int size);
  int size() const { return size_; }
  // Rank r's handle (the group must outlive it).
  std::unique_ptr<Communicator> communicator(int rank);

 private:
  friend class FakeCommunicator;
  // What each rank published for the collective in progress.
  struct Posted {
    const float* send = nullptr;
    size_t count = 0;
    const char* op = "";
  };
  // Publishes this rank's buffer and waits for every rank; checks that all ranks are in the same
  // collective with the same count (a mismatch is a bug that would hang NCCL).
  void post_and_wait(int rank, const char* op, const float* send, size_t count);

  int size_;
  std::vector<Posted> posted_;
  std::barrier<> arrive_;
};

}  // namespace moelora
