// A PEFT LoRA adapter turned into moelora's internal layout for one base model: per layer, one
// (A, B·scale) pair per dense projection and one stacked set of factors for the routed experts.
// Both PEFT expert layouts (per-expert modules, and fused 3-D `target_parameters`) become the
// same ExpertLora, so nothing downstream knows which one the file used.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/model_config.h"
#include "model/model_weights.h"

namespace moelora {

// One projection's LoRA: a [rank, in], b [out, rank] with the adapter's scale folded in (f32).
struct LoraFactor {
  Tensor a;
  Tensor b;
  int rank = 0;  // 0 = the adapter does not touch this projection
};

// Routed-expert LoRA of one MoE layer (f32, scale folded into the B factors).
// gate_up: one LoRA over the fused [2I, H] parameter, rows [0, I) gate and [I, 2I) up. Per-expert
// files with separate gate_proj / up_proj LoRAs are stacked as A = [A_gate; A_up] and a
// block-diagonal B, which is the same math.
struct ExpertLora {
  Tensor gu_a;  // [E or 1, gu_rank, H]   (1 = shared by all experts)
  Tensor gu_b;  // [E, 2I, gu_rank]
  int gu_rank = 0;
  Tensor d_a;   // [E, d_rank, I]
  Tensor d_b;   // [E or 1, H, d_rank]
  int d_rank = 0;
  bool any() const { return gu_rank > 0 || d_rank > 0; }
};

// What an adapter was read from: re-reads compare it, so changed files get a new identity
// (and new prefix-cache keys) instead of being served under the old one.
struct AdapterFilesIdentity {
  uint64_t bytes = 0;     // all files read
  int64_t mtime_ns = 0;   // the newest of them
  uint64_t hash = 0;      // of their contents
  bool operator==(const AdapterFilesIdentity&) const = default;
};

struct LoraAdapter {
  std::string name;
  std::string path;
  AdapterFilesIdentity identity;
  std::vector<std::array<LoraFactor, kNumLoraTargets>> dense;  // [layer][target]
  std::vector<ExpertLora> experts;                             // [layer]
  int max_rank = 0;
  size_t bytes = 0;                 // host memory held by the factors
  std::vector<std::string> notes;   // decisions worth logging (layout fallbacks)
};

struct AdapterLoadOptions {
  int max_rank = 256;
  // When set, every file is opened only if its real path (symlinks resolved, checked again on
  // the open descriptor) lies inside this folder. Files are always opened without following a
  // final symlink swapped in after the check, without blocking (a FIFO fails at once), and
  // only when they are regular files.
  std::string root;
  // The dtype the backend's adapter slots take (Backend::lora_dtype: f32 on the CPU, bf16 on
  // CUDA). Factors are built in f32 (scale folded into B) and converted once, here, on the
  // loading thread: placing an adapter in a slot is then a plain copy on the slot pool's worker (the
  // per-element conversion ran there before: a Qwen3-30B-A3B r16 adapter on every target holds
  // ~845M values, 630M of them in the expert factors),
  // and the host copy of a bf16 backend's adapter is half the size.
  DType factor_dtype = DType::kF32;
};

// Converts every factor of `a` to `dtype` (f32 or bf16; round to nearest even, the rounding the
// CUDA upload applied) and recomputes `bytes`. No-op when they already are.
void convert_adapter_factors(LoraAdapter& a, DType dtype);
// True when every factor of `a` is in `dtype`.
bool factors_are(const LoraAdapter& a, DType dtype);

// Loads `dir` (adapter_config.json + adapter_model.safetensors) for a model with config `cfg`.
// Every problem is a clear error naming the field, tensor or module; nothing is half-loaded.
// Errors never quote file contents that are not a valid adapter (a header length, a JSON token).
Result<std::shared_ptr<const LoraAdapter>> load_lora_adapter(const std::string& dir, const std::string& name,
                                                             const ModelConfig& cfg,
                                                             const AdapterLoadOptions& opts = {});

}  // namespace moelora
