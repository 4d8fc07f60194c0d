// Shared pieces of the block workbenches (moe_block.cu, attention_block.cu): a bench config read
// from bench/configs, the backend's values on the host, and the bit-for-bit comparison of a
// replayed step with its eager one that both report.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"
#include "model/model_config.h"
#include "ops/backend.h"

namespace moelora::dev {

// bench/configs/<file>, read from the repository root; nullopt (and a message) if it cannot be.
inline std::optional<ModelConfig> bench_config(const std::string& file) {
  const std::string path = "bench/configs/" + file;
  auto text = read_text_file(path);
  if (!text.ok()) {
    std::fprintf(stderr, "%s: %s (run from the repository root)\n", path.c_str(), text.status().message().c_str());
    return std::nullopt;
  }
  auto parsed = parse_model_config(*text, path);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", parsed.status().message().c_str());
    return std::nullopt;
  }
  return *parsed;
}

inline std::vector<float> host_values(Backend& b, const Tensor& t) {
  Tensor h = b.to_host_f32(t);
  const float* p = h.ptr<float>();
  return std::vector<float>(p, p + h.numel());
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How two outputs differ: elements whose bits differ, and the largest |difference|.
inline std::string difference(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ++n;
      worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
    }
  return std::to_string(n) + " of " + std::to_string(a.size()) + " differ, max |d| " + std::to_string(worst);
}

}  // namespace moelora::dev
