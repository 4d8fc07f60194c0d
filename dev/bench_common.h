// Workbench timing (DESIGN "Conventions" 3, device/METHOD.md): CUDA-graph replay of the measured
// launch(es), inputs rotated among several copies so that each replay reads from HBM (the H200's
// L2 is 50 MB), median of repeats, and ceilings measured in the same run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "backends/cuda/cuda_check.h"

namespace moelora::dev {

// How many input copies defeat the L2 for a working set of `bytes` (at least 2, ~200 MB total).
inline int rotation_copies(size_t bytes) {
  const size_t target = 200u << 20;
  return static_cast<int>(std::max<size_t>(2, std::min<size_t>(64, target / std::max<size_t>(bytes, 1) + 1)));
}

// Times `launch(copy_index)` captured in a CUDA graph that replays every copy once; returns the
// median time per launch in microseconds over `reps` graph replays.
inline double time_graph_us(const std::function<void(cudaStream_t, int)>& launch, int copies, int reps = 20) {
  cudaStream_t s;
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Warm up (module load, first-touch).
  for (int c = 0; c < copies; ++c) launch(s, c);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  MOELORA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < copies; ++c) launch(s, c);
  MOELORA_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  MOELORA_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  MOELORA_CUDA_CHECK(cudaEventCreate(&a));
  MOELORA_CUDA_CHECK(cudaEventCreate(&b));
  MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, s));
  std::vector<float> ms(reps);
  for (int r = 0; r < reps; ++r) {
    MOELORA_CUDA_CHECK(cudaEventRecord(a, s));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, s));
    MOELORA_CUDA_CHECK(cudaEventRecord(b, s));
    MOELORA_CUDA_CHECK(cudaEventSynchronize(b));
    MOELORA_CUDA_CHECK(cudaEventElapsedTime(&ms[r], a, b));
  }
  std::sort(ms.begin(), ms.end());
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(ge));
  MOELORA_CUDA_CHECK(cudaGraphDestroy(g));
  MOELORA_CUDA_CHECK(cudaEventDestroy(a));
  MOELORA_CUDA_CHECK(cudaEventDestroy(b));
  MOELORA_CUDA_CHECK(cudaStreamDestroy(s));
  return ms[reps / 2] * 1000.0 / copies;
}

// Device-to-device copy bandwidth (bytes read + written per second) on `bytes` per copy.
inline double measure_copy_gbps(size_t bytes = 1u << 30) {
  void *src, *dst;
  MOELORA_CUDA_CHECK(cudaMalloc(&src, bytes));
  MOELORA_CUDA_CHECK(cudaMalloc(&dst, bytes));
  MOELORA_CUDA_CHECK(cudaMemset(src, 1, bytes));
  const double us = time_graph_us(
      [&](cudaStream_t s, int) { MOELORA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); },
      1, 10);
  MOELORA_CUDA_CHECK(cudaFree(src));
  MOELORA_CUDA_CHECK(cudaFree(dst));
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

}  // namespace moelora::dev
