// Shared machinery of the op suite (DESIGN "Conventions" 2): cases are small structs whose
// printed parameters are the test name and the RNG seed; outputs are compared with the CPU
// reference per row (||out - ref|| / ||ref||), checked for NaN/inf, and written into buffers with
// guard regions that must stay untouched.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "core/dtype.h"

namespace moelora::ops_test {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define MOELORA_REQUIRE_GPU()                                        \
  do {                                                               \
    if (!::moelora::ops_test::gpu_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Deterministic seed from a case name (FNV-1a).
inline uint64_t seed_of(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  float normal(float stddev = 1.0f) { return std::normal_distribution<float>(0.0f, stddev)(gen); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }  // inclusive
  std::vector<float> normals(size_t n, float stddev = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(stddev);
    return v;
  }
};

// Rounds through bf16 so the CPU reference sees exactly what the GPU sees.
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}
inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = bf16_to_f32(v[i]);
  return o;
}

// A device buffer with a poisoned guard region after the payload.
template <typename T>
class DeviceArray {
 public:
  static constexpr size_t kGuard = 256;  // elements
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : n_(n) {
    MOELORA_CUDA_CHECK(cudaMalloc(&p_, (n + kGuard) * sizeof(T) + 16));
    MOELORA_CUDA_CHECK(cudaMemset(p_, 0xA5, (n + kGuard) * sizeof(T) + 16));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    MOELORA_CHECK(host.size() <= n_);
    MOELORA_CUDA_CHECK(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  // Fills the payload with a byte pattern (poison before a kernel writes it).
  void poison(uint8_t byte = 0xA5) { MOELORA_CUDA_CHECK(cudaMemset(p_, byte, n_ * sizeof(T))); }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    MOELORA_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // True when the guard region still holds the poison pattern.
  bool guard_intact() const {
    std::vector<uint8_t> g(kGuard * sizeof(T));
    MOELORA_CUDA_CHECK(cudaMemcpy(g.data(), reinterpret_cast<const uint8_t*>(p_) + n_ * sizeof(T), g.size(),
                                  cudaMemcpyDeviceToHost));
    for (uint8_t b : g)
      if (b != 0xA5) return false;
    return true;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

struct Comparison {
  double worst_rel = 0.0;  // max over rows of ||out - ref|| / ||ref||
  int worst_row = -1;
  bool non_finite = false;
};

// Row-wise relative error; rows with ||ref|| == 0 compare ||out|| against `zero_abs`.
inline Comparison compare_rows(const std::vector<float>& out, const std::vector<float>& ref, int64_t rows,
                               int64_t cols, double zero_abs = 1e-6) {
  Comparison c;
  for (int64_t r = 0; r < rows; ++r) {
    double num = 0.0, den = 0.0;
    for (int64_t j = 0; j < cols; ++j) {
      const double o = out[r * cols + j], f = ref[r * cols + j];
      if (!std::isfinite(o)) c.non_finite = true;
      num += (o - f) * (o - f);
      den += f * f;
    }
    const double rel = den > 0 ? std::sqrt(num / den) : (std::sqrt(num) > zero_abs ? 1.0 : 0.0);
    if (rel > c.worst_rel) {
      c.worst_rel = rel;
      c.worst_row = static_cast<int>(r);
    }
  }
  return c;
}

#define EXPECT_CLOSE_ROWS(out, ref, rows, cols, tol)                                            \
  do {                                                                                          \
    auto _c = ::moelora::ops_test::compare_rows((out), (ref), (rows), (cols));                   \
    EXPECT_FALSE(_c.non_finite) << "NaN or inf in the output";                                  \
    EXPECT_LE(_c.worst_rel, (tol)) << "worst row " << _c.worst_row << " relative error " << _c.worst_rel; \
  } while (0)

}  // namespace moelora::ops_test
