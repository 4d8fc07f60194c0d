// Runs reference fixtures (tests/fixtures/README.md: cases.json + expected-*.safetensors made
// by Hugging Face transformers + PEFT in float64) through a backend, every case of a checkpoint
// in ONE batch that mixes all adapters and the base model: prefill logits at every position and
// teacher-forced decode logits, compared row by row.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "ops/backend.h"

namespace moelora {

struct LoraAdapter;

// What runs a checkpoint's steps. The default places the adapters in a LoraSlotPool on the
// model's backend and calls Model::forward; `moelora verify --tp/--ep` plugs in the sharded CPU
// forward (src/parallel) here.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // The adapter's slot, as the tokens of the batch will name it.
  virtual Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter) = 0;
  virtual void alloc_kv_cache(int num_pages, int page_size) = 0;
  // Logits of batch.logit_rows, host float32 [rows, vocab].
  virtual Tensor forward(const StepBatch& batch) = 0;
};
// Makes the runner of one checkpoint from its loaded model and the adapter slots it needs.
using MakeStepRunner = std::function<Result<std::unique_ptr<StepRunner>>(Model& model, int num_slots)>;

// Row error = ||out - ref|| / ||ref|| per logits row; top-1 is counted on rows whose reference
// top-1/top-2 gap is at least `tie_margin` x RMS(row).
// Exact mode (the float32 CPU path): every row within `max_rel_error`, every counted top-1 right.
// Statistical mode (bf16 activations: GPU, cpu-bf16): a router near-tie can flip one token's
// expert in bf16 and every later row of that sequence follows (docs/numerics.md shows the CPU
// emulating bf16 storage flips the same rows), so a case passes when its typical row is right
// (median <= case_max_median, while a wrong adapter moves every row by 50-140 %) and its counted
// top-1 agreement is >= case_min_top1; a checkpoint passes when its median row error is
// <= ckpt_max_median and its top-1 agreement >= ckpt_min_top1.
struct VerifyOptions {
  bool exact = true;
  double max_rel_error = 1e-4;   // exact mode: every row; both modes: the "within" count
  double tie_margin = 1e-3;
  double case_max_median = 0.1;
  double case_min_top1 = 0.75;
  double ckpt_max_median = 2e-2;
  double ckpt_min_top1 = 0.97;
  MakeStepRunner make_runner;  // empty: Model::forward on the backend
  ModelOptions model;          // how each checkpoint is loaded (MLA form)
  static VerifyOptions for_bf16() {
    VerifyOptions o;
    o.exact = false;
    o.max_rel_error = 3e-2;
    o.tie_margin = 5e-2;  // a gap below ~the bf16 row error is not a decision the engine can hold
    return o;
  }
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
