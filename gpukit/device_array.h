// The one device buffer of the op suite (tests/ops) and the kernel workbenches (dev/): an owning
// array of T on the current device with a poisoned guard region after the payload.
//
// Why the guard everywhere, benches included: a test checks that a kernel wrote nothing past its
// output (guard_intact), and a workbench copy costs the same 256 elements plus one memset, which
// is nothing next to what it times. A workbench that rotates inputs past the L2 makes its copies
// with clone() (same values, another address).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "core/check.h"

namespace moelora::gpukit {

// True when a CUDA device is usable (the op suite skips without one, dev_moe_bench says so and exits).
inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// n elements at a device address no DeviceArray owns (a kernel's carved workspace, say).
template <typename T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> h(n);
  if (n) MOELORA_CUDA_CHECK(cudaMemcpy(h.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <typename T>
class DeviceArray {
 public:
  static constexpr size_t kGuard = 256;   // elements after the payload
  static constexpr uint8_t kPoison = 0xA5;  // what the whole allocation starts as

  DeviceArray() = default;
  // n elements, all bytes (payload and guard) set to kPoison: reading unwritten memory shows.
  explicit DeviceArray(size_t n) : n_(n) {
    MOELORA_CUDA_CHECK(cudaMalloc(&p_, alloc_bytes()));
    MOELORA_CUDA_CHECK(cudaMemset(p_, kPoison, alloc_bytes()));
    settle();
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  // Host -> device into the first host.size() elements (the rest keeps what it held).
  void upload(const std::vector<T>& host) {
    MOELORA_CHECK(host.size() <= n_);
    if (!host.empty())
      MOELORA_CUDA_CHECK(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    settle();
  }
  // The whole payload, or its first `count` elements.
  std::vector<T> download() const { return download(n_); }
  std::vector<T> download(size_t count) const {
    MOELORA_CHECK(count <= n_);
    return gpukit::download(p_, count);
  }
  // Fills the payload with a byte pattern (poison before a kernel writes it; the guard keeps kPoison).
  void poison(uint8_t byte = kPoison) {
    MOELORA_CUDA_CHECK(cudaMemset(p_, byte, bytes()));
    settle();
  }
  // Another array with the same payload at another address (workbench rotation copies).
  DeviceArray clone() const {
    DeviceArray c(n_);
    if (n_) MOELORA_CUDA_CHECK(cudaMemcpy(c.p_, p_, bytes(), cudaMemcpyDeviceToDevice));
    settle();
    return c;
  }
  // True when the guard region still holds the poison pattern.
  bool guard_intact() const {
    std::vector<uint8_t> g(kGuard * sizeof(T));
    MOELORA_CUDA_CHECK(cudaMemcpy(g.data(), reinterpret_cast<const uint8_t*>(p_) + bytes(), g.size(),
                                  cudaMemcpyDeviceToHost));
    for (uint8_t b : g)
      if (b != kPoison) return false;
    return true;
  }

 private:
  // cudaMemset is asynchronous to the host on the legacy stream, and a pageable cudaMemcpy to the
  // device may return before its DMA lands: kernels the tests launch on their own non-blocking
  // streams do not wait for either. On 2026-12-05 the first fused-routing MoE case of each op-suite
  // shard found every router id poisoned (a late poison memset is the likely cause; the same cases
  // passed later in a process). So every write settles before the test goes on.
  static void settle() { MOELORA_CUDA_CHECK(cudaDeviceSynchronize()); }
  // The guard plus 16 bytes of slack, the layout the op suite's buffers always had.
  size_t alloc_bytes() const { return (n_ + kGuard) * sizeof(T) + 16; }

  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace moelora::gpukit
