// The collectives a sharded forward pass needs, as an interface. One Communicator is one rank's
// handle on one group of ranks (the whole world, or one tensor-parallel group). On GPUs it is filled
// by NCCL (one process per GPU, ncclCommInitRank / ncclCommSplit, calls enqueued on the backend's
// stream; docs/multi_gpu.md); FakeCommunicator (fake_communicator.h) fills it with threads of one
// process so that the sharding math is tested on the CPU.
//
// Every rank of a group must make the same sequence of calls with the same counts (that is what
// NCCL requires too: a mismatch there hangs, the fake aborts with a message). A collective has no
// error return: a failed one leaves the ranks out of step, which no caller can repair; an NCCL
// implementation aborts (MOELORA_CHECK) and the process supervisor restarts the replica.
#pragma once

#include <cstddef>

namespace moelora {

class Communicator {
 public:
  virtual ~Communicator() = default;
  // This rank's index in the group, 0 .. size() - 1.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: on return data[i] on every rank is the sum of data[i] over all ranks. Every rank
  // receives bitwise the same values (the replicated activations of a sharded forward rely on it:
  // ranks that disagree by one ulp could route a token to different experts).
  virtual void all_reduce_sum(float* data, size_t count) = 0;
  // recv [size() * count] receives every rank's `send` [count], rank r's at recv + r * count.
  virtual void all_gather(const float* send, size_t count, float* recv) = 0;
  // Returns once every rank of the group has called it.
  virtual void barrier() = 0;
};

}  // namespace moelora
