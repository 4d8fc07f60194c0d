// Graph-replay timing and the bandwidth ceilings of gpukit/timing.h. The kernels live here, in one
// translation unit, so every workbench links the same definitions.
#include "gpukit/timing.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_info.h"
#include "gpukit/device_array.h"

namespace moelora::gpukit {
namespace {

// 4 independent 16-byte loads per thread before their stores: enough bytes in flight per SM.
__global__ void copy_kernel_u4(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a, dst[i + stride] = b, dst[i + 2 * stride] = c, dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__global__ void empty_kernel() {}

}  // namespace

int rotation_copies(size_t bytes) {
  const size_t target = 200u << 20;
  return static_cast<int>(std::max<size_t>(2, std::min<size_t>(64, target / std::max<size_t>(bytes, 1) + 1)));
}

double time_graph_us(const std::function<void(cudaStream_t, int)>& launch, int copies, int reps) {
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

double measure_copy_gbps(size_t bytes) {
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

double measure_copy_kernel_gbps(size_t bytes) {
  void *src, *dst;
  MOELORA_CUDA_CHECK(cudaMalloc(&src, bytes));
  MOELORA_CUDA_CHECK(cudaMalloc(&dst, bytes));
  MOELORA_CUDA_CHECK(cudaMemset(src, 1, bytes));
  const cuda::DeviceInfo d = cuda::query_device();
  const double us = time_graph_us(
      [&](cudaStream_t s, int) {
        copy_kernel_u4<<<d.num_sms * 4, 512, 0, s>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst), bytes / 16);
      },
      1, 10);
  MOELORA_CUDA_CHECK(cudaFree(src));
  MOELORA_CUDA_CHECK(cudaFree(dst));
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

double measure_empty_node_us() {
  return time_graph_us([](cudaStream_t s, int) { empty_kernel<<<132, 128, 0, s>>>(); }, 64, 20);
}

double print_ceilings(const char* bench) {
  const cuda::DeviceInfo d = cuda::query_device();
  const double memcpy_gbs = measure_copy_gbps();
  const double kernel_gbs = measure_copy_kernel_gbps();
  const double copy = std::max(memcpy_gbs, kernel_gbs);
  std::printf("# %s on %s (%d SMs, L2 %zu MB); copy ceiling %.0f GB/s (read+write, 1 GiB, graph replay median; "
              "copy kernel %.0f, cudaMemcpyAsync %.0f); empty graph node %.2f us\n",
              bench, d.name.c_str(), d.num_sms, d.l2_bytes >> 20, copy, kernel_gbs, memcpy_gbs, measure_empty_node_us());
  return copy;
}

}  // namespace moelora::gpukit
