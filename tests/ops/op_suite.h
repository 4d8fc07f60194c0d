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
#include "ops/types.h"

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

// Step `step` of a case whose sequences first bring fresh[s] tokens after cached[s] positions, then
// one token each per step: token ids 0, positions, sequences, the pages, slot_of(s) for every token
// of sequence s, and each sequence's last token as a logit row.
template <class SlotOf>
StepBatch multi_step_batch(const std::vector<std::vector<int32_t>>& pages, const std::vector<int>& cached,
                           const std::vector<int>& fresh, int step, SlotOf slot_of) {
  StepBatch b;
  b.seq_pages = pages;
  for (int s = 0; s < static_cast<int>(cached.size()); ++s) {
    const int n = step == 0 ? fresh[s] : 1;
    const int first = cached[s] + (step == 0 ? 0 : fresh[s] + step - 1);
    const int slot = slot_of(s);
    for (int i = 0; i < n; ++i) {
      b.token_ids.push_back(0);
      b.positions.push_back(first + i);
      b.token_seq.push_back(s);
      b.token_slot.push_back(slot);
    }
    if (n > 0) b.logit_rows.push_back(b.num_tokens() - 1);
  }
  return b;
}

#define EXPECT_CLOSE_ROWS(out, ref, rows, cols, tol)                                            \
  do {                                                                                          \
    auto _c = ::moelora::gpukit::compare_rows((out), (ref), (rows), (cols));                    \
    EXPECT_FALSE(_c.non_finite) << "NaN or inf in the output";                                  \
    EXPECT_LE(_c.worst_rel, (tol)) << "worst row " << _c.worst_row << " relative error " << _c.worst_rel; \
  } while (0)

}  // namespace moelora::ops_test
