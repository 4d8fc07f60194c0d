// The GoogleTest glue of the op suite: cases are small structs whose
// printed parameters are the test name and the RNG seed; outputs are compared with the CPU
// reference per row (||out - ref|| / ||ref||), checked for NaN/inf, and written into buffers with
// guard regions that must stay untouched. Everything that is not GoogleTest (buffers, data,
// references, the error itself) is the GPU kit's (gpukit/), which the workbenches in dev/ share.
#pragma once

#include <gtest/gtest.h>

#include <cctype>
#include <string>

#include "gpukit/device_array.h"
#include "gpukit/numeric.h"
#include "gpukit/random.h"

namespace moelora::ops_test {

// The cases are written against the kit's names (DeviceArray, Rng, seed_of, compare_rows, ...).
using namespace moelora::gpukit;

#define MOELORA_REQUIRE_GPU()                                                      \
  do {                                                                             \
    if (!::moelora::gpukit::gpu_available()) GTEST_SKIP() << "no CUDA device";     \
  } while (0)

// gtest parameter names allow [A-Za-z0-9_] only: the printed case name with the rest mapped to '_'.
// The dense families drop trailing '_' (their names end in ')'); the MoE families keep it, as
// their names have been since the first recorded runs (tests/ops/records, --gtest_filter lists).
inline std::string gtest_safe(const std::string& s, bool trim_trailing = true) {
  std::string o;
  for (char c : s) o += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  while (trim_trailing && !o.empty() && o.back() == '_') o.pop_back();
  return o;
}

#define EXPECT_CLOSE_ROWS(out, ref, rows, cols, tol)                                            \
  do {                                                                                          \
    auto _c = ::moelora::gpukit::compare_rows((out), (ref), (rows), (cols));                    \
    EXPECT_FALSE(_c.non_finite) << "NaN or inf in the output";                                  \
    EXPECT_LE(_c.worst_rel, (tol)) << "worst row " << _c.worst_row << " relative error " << _c.worst_rel; \
  } while (0)

}  // namespace moelora::ops_test
