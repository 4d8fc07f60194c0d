// Deterministic host data for the op suite and the workbenches. Two generators on purpose:
//   Rng      mt19937_64 + the standard distributions: the op suite's case inputs (seeded by
//            seed_of(case name), so a case's values never change while its name does not);
//   FastRng  splitmix64 + a sum-of-uniforms normal: ~10x cheaper, for the hundreds of MB of
//            full-size expert sets and workbench weights.
// Changing either stream changes every recorded case's inputs: extend, never edit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace moelora::gpukit {

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

struct FastRng {
  uint64_t s;
  explicit FastRng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  // Sum of 4 uniforms scaled to unit variance, times sd: close enough to normal for weights.
  // The draws are named so that their order is fixed, not left to the compiler.
  float normal(float sd = 1.0f) {
    const float a = uniform(), b = uniform(), c = uniform(), d = uniform();
    return (a + b + c + d - 2.0f) * 1.7320508f * sd;
  }
  int integer(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }  // inclusive
};

// n bf16 values ~ N(0, sd) (bits in the return, their exact floats in `vals` when given).
inline std::vector<uint16_t> random_bf16(FastRng& r, size_t n, float sd, std::vector<float>* vals = nullptr) {
  std::vector<uint16_t> b(n);
  if (vals) vals->resize(n);
  for (size_t i = 0; i < n; ++i) {
    b[i] = f32_to_bf16(r.normal(sd));
    if (vals) (*vals)[i] = bf16_to_f32(b[i]);
  }
  return b;
}

// `rows` x K random e4m3 codes with exponents 4..11 (magnitudes 2^-3 .. 2^4 x 1.m): a spread like
// real weights, no NaN codes; the block scales `s` (sized by the caller: its layout is the
// caller's) put the dequantised weights near N(0, 1/sqrt(K)). Eight codes per draw: full-size
// expert sets are ~600 MB.
inline void random_fp8(FastRng& r, std::vector<uint8_t>& q, std::vector<float>& s, size_t rows, int K) {
  q.resize(rows * K);
  for (size_t i = 0; i < q.size(); i += 8) {
    uint64_t v = r.next();
    for (size_t j = 0; j < 8 && i + j < q.size(); ++j, v >>= 8) {
      const uint8_t b = static_cast<uint8_t>(v);
      q[i + j] = static_cast<uint8_t>((b & 0x80) | ((4 + ((b >> 3) & 7)) << 3) | (b & 7));
    }
  }
  for (auto& x : s) x = (0.5f + r.uniform()) / (5.0f * std::sqrt(static_cast<float>(K)));
}

}  // namespace moelora::gpukit
