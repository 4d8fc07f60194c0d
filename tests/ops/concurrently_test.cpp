// CudaBackend::concurrently with shared_experts_concurrent: `first` runs on a stream of its own
// while `second` is queued, so scratch that `first` gives back (scratch_release once its launches
// are queued, as linear and the LoRA GEMM path do) is still in use on that stream. `second` must
// never be handed those bytes: on the first H100 run of dev_moe_block (2026-12-07) the shared
// experts' LoRA u buffer, given back, became the routed layer's workspace and the GEMM read
// garbage tiles (an illegal address).
#include <cstdint>

#include "backends/cuda/cuda_backend.h"
#include "core/tensor.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

struct Range {
  uintptr_t begin = 0, end = 0;
  bool overlaps(const Range& o) const { return begin < o.end && o.begin < end; }
};
Range range_of(const Tensor& t) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.data());
  return {b, b + static_cast<uintptr_t>(t.rows() * t.ld() * dtype_size(t.dtype()))};
}

void expect_second_above_first(bool concurrent) {
  CudaBackendOptions o;
  o.graphs = false;
  o.arena_bytes = 16u << 20;
  o.shared_experts_concurrent = concurrent;
  CudaBackend gpu(o);
  const StepBatch b = multi_step_batch({{0}}, {0}, {4}, 0, [](int) { return -1; });
  ASSERT_EQ(gpu.begin_step(b).num_tokens(), 4);
  Range kept, given_back, second;
  gpu.concurrently(
      [&] {
        kept = range_of(gpu.alloc_act(4, 256));
        const size_t mark = gpu.scratch_mark();
        given_back = range_of(gpu.alloc_act(64, 512));  // a linear's scratch, released once queued
        gpu.scratch_release(mark);
      },
      [&] { second = range_of(gpu.alloc_act(64, 512)); });
  EXPECT_FALSE(second.overlaps(kept)) << "second's scratch overlaps what first still holds";
  if (concurrent) {
    EXPECT_FALSE(second.overlaps(given_back)) << "second's scratch is what first gave back while its stream may run";
  } else {
    // One stream: everything of `second` runs after `first`, so reusing its scratch is right.
    EXPECT_TRUE(second.overlaps(given_back)) << "serial concurrently no longer reuses given-back scratch";
  }
  // After the join both are done: the layer's scratch comes back as usual.
  const size_t mark = gpu.scratch_mark();
  const Range after = range_of(gpu.alloc_act(4, 256));
  gpu.scratch_release(mark);
  EXPECT_FALSE(after.overlaps(second));
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaConcurrently, SecondNeverGetsScratchFirstGaveBack) {
  MOELORA_REQUIRE_GPU();
  expect_second_above_first(/*concurrent=*/true);
}

TEST(CudaConcurrently, SerialReusesScratchAsBefore) {
  MOELORA_REQUIRE_GPU();
  expect_second_above_first(/*concurrent=*/false);
}

}  // namespace
}  // namespace moelora::ops_test
