// Helpers for the parallel tests: run a function on N ranks (threads sharing a FakeCommGroup),
// random tensors, and row-wise relative differences.
#pragma once

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "parallel/fake_communicator.h"

namespace moelora::testing_parallel {

// fn(rank, comm) on `n` threads, one per rank of a fresh group.
template <typename Fn>
void run_ranks(int n, Fn fn) {
  FakeCommGroup group(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&group, &fn, r] {
      auto comm = group.communicator(r);
      fn(r, *comm);
    });
  for (std::thread& t : threads) t.join();
}

inline Tensor random_f32(const std::vector<int64_t>& shape, uint32_t seed, float scale = 0.5f) {
  Tensor t = Tensor::empty_host(DType::kF32, shape);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = u(g);
  return t;
}

// Columns [begin, begin + count) of a contiguous 2-D tensor, copied.
inline Tensor columns(const Tensor& t, int64_t begin, int64_t count) {
  Tensor out = Tensor::empty_host(DType::kF32, {t.rows(), count});
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < count; ++c) out.ptr<float>()[r * count + c] = t.ptr<float>()[r * t.ld() + begin + c];
  return out;
}

// ||a[r] - b[r]|| / ||b[r]|| for row r (0 when both rows are zero).
inline double row_rel_diff(const Tensor& a, const Tensor& b, int64_t r) {
  double num = 0, den = 0;
  for (int64_t c = 0; c < b.cols(); ++c) {
    const double x = a.ptr<float>()[r * a.ld() + c], y = b.ptr<float>()[r * b.ld() + c];
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace moelora::testing_parallel
