// How the device's memory is shared out at start-up (vLLM's --gpu-memory-utilization): weights
// and the step scratch are measured (after a warm-up step of the largest shape the engine will
// run), adapter slots are reserved for `max_loras_per_batch` adapters of `max_lora_rank` on every
// target, and the KV cache gets what is left of `utilization` x the device's memory. A plan that
// cannot hold one sequence of the model's length is refused with what to change.
#pragma once

#include <cstddef>
#include <string>

#include "core/status.h"
#include "model/model.h"
#include "model/model_config.h"

namespace moelora {

struct MemoryInputs {
  size_t device_total = 0;      // bytes on the device
  size_t device_free = 0;       // free now: after weights, step scratch and sampling buffers
  double utilization = 0.90;    // fraction of device_total the process may hold
  size_t adapter_reserve = 0;   // bytes kept free for adapter slots
  size_t page_bytes = 0;        // one KV page over all layers
  int pages_per_sequence = 0;   // pages of one sequence of the maximum length
  int kv_pages_override = 0;    // > 0: use this many pages (must still fit)
  size_t scratch_bytes = 0;     // the warm-up's step scratch (already in use; reported only)
};

struct MemoryPlan {
  int kv_pages = 0;
  size_t kv_bytes = 0;
  size_t budget = 0;  // bytes the process may still take (utilization x total - in use)
  std::string summary;  // one line for the start-up log
};

Result<MemoryPlan> plan_memory(const MemoryInputs& in);

// Bytes of one adapter of rank `rank` on every LoRA target of `cfg` (bf16 factors; routed
// experts included), the size one adapter slot must be able to hold.
size_t adapter_slot_bytes(const ModelConfig& cfg, int rank);

// Bytes of one KV page of `page_size` positions over all layers, each layer's cache holding `kv`
// per position (Model::kv_shape: an MLA model in the absorbed form keeps kv_lora_rank + rope
// values per token and layer instead of heads x (nope + rope + v)), values of `act_bytes`.
size_t kv_page_bytes(const ModelConfig& cfg, const KvShape& kv, int page_size, size_t act_bytes);

}  // namespace moelora
