// bf16 <-> f32 vectors and the row-wise relative error every GPU-vs-CPU comparison uses: the op
// suite's EXPECT_CLOSE_ROWS (tests/ops/op_suite.h) and the workbenches' checks print the same
// number, so a bench check and a test on the same data agree.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace moelora::gpukit {

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

struct Comparison {
  double worst_rel = 0.0;  // max over rows of ||out - ref|| / ||ref||
  int worst_row = -1;
  bool non_finite = false;  // a NaN or inf anywhere in `out`
};

// Row-wise relative error of out against ref ([rows, cols] each); rows with ||ref|| == 0 count as
// 1.0 when ||out|| > zero_abs and 0.0 otherwise (a relative error of an all-zero row means nothing).
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

// compare_rows as one number for the workbenches' check lines: inf when out holds a NaN or inf.
inline double max_row_rel(const std::vector<float>& out, const std::vector<float>& ref, int64_t rows, int64_t cols) {
  const Comparison c = compare_rows(out, ref, rows, cols);
  return c.non_finite ? INFINITY : c.worst_rel;
}

}  // namespace moelora::gpukit
