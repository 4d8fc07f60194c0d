// Small helpers for the dense / LoRA / attention workbenches: device buffers filled from host
// vectors, random bf16 and FP8 data, relative errors, and the ceilings line every bench prints.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_info.h"
#include "core/dtype.h"
#include "dev/bench_common.h"

namespace moelora::dev {

template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  MOELORA_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) MOELORA_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) MOELORA_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Fast deterministic host randomness (splitmix64): the benches fill hundreds of MB.
struct HostRng {
  uint64_t s;
  explicit HostRng(uint64_t seed) : s(seed) {}
  uint64_t bits() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(bits() >> 40) * (1.0f / 16777216.0f); }
  // Sum of 4 uniforms scaled to unit variance: close enough to normal for benches.
  float normal(float sd = 1.0f) { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f * sd; }
  int integer(int lo, int hi) { return lo + static_cast<int>(bits() % static_cast<uint64_t>(hi - lo + 1)); }
};

// A device copy of `bytes` at `src` (rotation copies share values; only addresses must differ).
inline void* clone_device(const void* src, size_t bytes) {
  void* d = nullptr;
  MOELORA_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(bytes, 1)));
  if (bytes) MOELORA_CUDA_CHECK(cudaMemcpy(d, src, bytes, cudaMemcpyDeviceToDevice));
  return d;
}

// bf16 values (exact floats in `vals`, bits in the return).
inline std::vector<uint16_t> random_bf16(HostRng& r, size_t n, float sd, std::vector<float>* vals = nullptr) {
  std::vector<uint16_t> b(n);
  if (vals) vals->resize(n);
  for (size_t i = 0; i < n; ++i) {
    b[i] = f32_to_bf16(r.normal(sd));
    if (vals) (*vals)[i] = bf16_to_f32(b[i]);
  }
  return b;
}

// FP8 codes with exponents 4..11 (no NaN codes) and block scales ~ 1/(5 sqrt(K)).
inline void random_fp8(HostRng& r, int out, int in, std::vector<uint8_t>& q, std::vector<float>& s) {
  q.resize(static_cast<size_t>(out) * in);
  for (auto& c : q) {
    const uint8_t b = static_cast<uint8_t>(r.bits());
    c = static_cast<uint8_t>((b & 0x80) | ((4 + ((b >> 3) & 7)) << 3) | (b & 7));
  }
  s.resize(static_cast<size_t>((out + 127) / 128) * ((in + 127) / 128));
  for (auto& x : s) x = (0.5f + (r.bits() % 1000) / 1000.0f) / (5.0f * std::sqrt(static_cast<float>(in)));
}

// max over rows of ||a - b|| / ||b||.
inline double max_row_rel(const std::vector<float>& a, const std::vector<float>& b, int64_t rows, int64_t cols) {
  double worst = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    double n = 0.0, d = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double e = a[r * cols + c] - b[r * cols + c];
      if (!std::isfinite(a[r * cols + c])) return INFINITY;
      n += e * e;
      d += static_cast<double>(b[r * cols + c]) * b[r * cols + c];
    }
    worst = std::max(worst, d > 0 ? std::sqrt(n / d) : std::sqrt(n));
  }
  return worst;
}

inline std::vector<float> bf16_to_float(const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_f32(v[i]);
  return o;
}

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

// Time of one graph node that does nothing: the per-launch floor under graph replay, to read the
// small-kernel figures against.
inline double measure_empty_node_us() {
  return time_graph_us([](cudaStream_t s, int) { empty_kernel<<<132, 128, 0, s>>>(); }, 64, 20);
}

// Device-to-device copy through a kernel (16-byte loads / stores, 4 blocks of 512 per SM): the
// DMA engine behind cudaMemcpyAsync moves less on this machine, so kernels are judged against this.
inline double measure_copy_kernel_gbps(size_t bytes = size_t(1) << 30) {
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

// Prints the device and the copy ceilings measured now; returns the larger, in GB/s.
inline double print_ceilings(const char* bench) {
  const cuda::DeviceInfo d = cuda::query_device();
  const double memcpy_gbs = measure_copy_gbps();
  const double kernel_gbs = measure_copy_kernel_gbps();
  const double copy = std::max(memcpy_gbs, kernel_gbs);
  std::printf("# %s on %s (%d SMs, L2 %zu MB); copy ceiling %.0f GB/s (read+write, 1 GiB, graph replay median; "
              "copy kernel %.0f, cudaMemcpyAsync %.0f); empty graph node %.2f us\n",
              bench, d.name.c_str(), d.num_sms, d.l2_bytes >> 20, copy, kernel_gbs, memcpy_gbs, measure_empty_node_us());
  return copy;
}

}  // namespace moelora::dev
