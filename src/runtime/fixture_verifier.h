// Runs reference fixtures (../shared/fixtures format: cases.json + expected-*.safetensors made
// by Hugging Face transformers + PEFT in float64) through a backend, every case of a checkpoint
// in ONE batch that mixes all adapters and the base model: prefill logits at every position and
// teacher-forced decode logits, compared row by row.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "ops/backend.h"

namespace moelora {

// Row error = ||out - ref|| / ||ref|| per logits row. A case passes when its median row error is
// within `max_rel_error` and its share of rows within it is at least `min_rows_within`; every
// checkpoint must also reach `min_rows_within` and `min_top1` over all its rows. The CPU path
// demands every row (1.0); the GPU path computes in bf16, where a near-tied router choice can
// flip an expert for a token (docs/numerics.md: the CPU emulating bf16 shows the same rows).
struct VerifyOptions {
  double max_rel_error = 1e-4;
  double min_rows_within = 1.0;
  double min_top1 = 1.0;         // fraction of clear-margin rows whose argmax must match
  // Rows whose reference top-1/top-2 gap is below this (relative to the row RMS) are near-ties:
  // their argmax is not counted against min_top1.
  double tie_margin = 1e-3;
};

struct CaseResult {
  std::string model;       // e.g. "qwen3moe/bf16"
  std::string case_id;     // "case7", or "case7@full-r16-per-expert" for same_outputs_as aliases
  std::string adapter;     // "" = base
  int prompt_len = 0;
  double prefill_rel = 0;  // worst row
  double decode_rel = 0;   // worst row
  double median_rel = 0;   // median row
  int rows = 0;
  int rows_within = 0;     // rows within max_rel_error
  int top1_match = 0;
  int top1_rows = 0;       // rows counted (near-ties excluded)
  bool passed = false;
};

struct CheckpointResult {
  std::string model;
  int rows = 0, rows_within = 0, top1_match = 0, top1_rows = 0;
  double median_rel = 0;
  bool passed = false;
};

struct VerifySummary {
  std::vector<CaseResult> cases;
  std::vector<CheckpointResult> checkpoints;
  int passed = 0, failed = 0;
  double worst_rel = 0;
  int top1_match = 0, top1_rows = 0;
};

// `root` is a model folder with cases.json, or a root with manifest.json (all its models).
// `make_backend` creates a fresh backend for each checkpoint. `on_case` sees each result.
Result<VerifySummary> verify_fixtures(const std::string& root, const std::function<std::unique_ptr<Backend>()>& make_backend,
                                      const VerifyOptions& opts,
                                      const std::function<void(const CaseResult&)>& on_case = nullptr,
                                      const std::function<void(const CheckpointResult&)>& on_checkpoint = nullptr);

}  // namespace moelora
