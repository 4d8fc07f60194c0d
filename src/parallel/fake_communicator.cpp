#include "parallel/fake_communicator.h"

#include <cstring>
#include <string_view>

#include "core/check.h"

namespace moelora {

// One rank's handle. Each collective is two barrier phases: (1) every rank publishes its buffer,
// (2) every rank has finished reading the others' buffers, so none may be overwritten before.
class FakeCommunicator final : public Communicator {
 public:
  FakeCommunicator(FakeCommGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_reduce_sum(float* data, size_t count) override {
    group_.post_and_wait(rank_, "all_reduce_sum", data, count);
    // Every rank sums the same inputs in the same order (rank 0, 1, ...), so every rank ends with
    // bitwise the same result, and the result does not depend on thread timing.
    sum_.assign(group_.posted_[0].send, group_.posted_[0].send + count);
    for (int r = 1; r < size(); ++r) {
      const float* src = group_.posted_[r].send;
      for (size_t i = 0; i < count; ++i) sum_[i] += src[i];
    }
    group_.arrive_.arrive_and_wait();
    if (count > 0) std::memcpy(data, sum_.data(), count * sizeof(float));
  }

  void all_gather(const float* send, size_t count, float* recv) override {
    group_.post_and_wait(rank_, "all_gather", send, count);
    for (int r = 0; r < size(); ++r)
      if (count > 0) std::memcpy(recv + static_cast<size_t>(r) * count, group_.posted_[r].send, count * sizeof(float));
    group_.arrive_.arrive_and_wait();
  }

  void barrier() override {
    group_.post_and_wait(rank_, "barrier", nullptr, 0);
    group_.arrive_.arrive_and_wait();  // the others' checks read what we posted
  }

 private:
  FakeCommGroup& group_;
  int rank_;
  std::vector<float> sum_;
};

FakeCommGroup::FakeCommGroup(int size) : size_(size), posted_(size), arrive_(size) {
  MOELORA_CHECK_MSG(size >= 1, "a communicator group needs at least one rank, not {}", size);
}

std::unique_ptr<Communicator> FakeCommGroup::communicator(int rank) {
  MOELORA_CHECK_MSG(rank >= 0 && rank < size_, "rank {} outside a group of {}", rank, size_);
  return std::make_unique<FakeCommunicator>(*this, rank);
}

void FakeCommGroup::post_and_wait(int rank, const char* op, const float* send, size_t count) {
  posted_[rank] = {send, count, op};
  arrive_.arrive_and_wait();
  for (int r = 0; r < size_; ++r)
    MOELORA_CHECK_MSG(std::string_view(posted_[r].op) == op && posted_[r].count == count,
                      "collective mismatch: rank {} called {}({} floats) while rank {} called {}({} floats)", rank, op,
                      count, r, posted_[r].op, posted_[r].count);
}

}  // namespace moelora
