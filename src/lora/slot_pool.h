// Adapter slots on the backend: the LoRA equivalent of KV pages. An adapter in use by a running
// request holds a slot (reference counted); unreferenced resident adapters stay until their slot
// is needed (LRU). Uploading fills the per-(layer, projection) pointer tables that kernels read.
// Every table entry of a slot is rewritten on each placement, so a slot never serves a previous
// adapter's weights (targets the new adapter lacks get rank 0).
#pragma once

#include <memory>
#include <vector>

#include "core/status.h"
#include "lora/adapter.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

class LoraSlotPool {
 public:
  LoraSlotPool(const ModelConfig& cfg, Backend& backend, int num_slots);

  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Slot of `adapter` with one more reference, placing it (LRU victim among unreferenced slots)
  // if needed. ResourceExhausted when every slot is referenced by other adapters.
  Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter);
  void release(int slot);
  // Would acquire() succeed now without waiting?
  bool can_acquire(const LoraAdapter* adapter) const;
  // Drops an unreferenced resident adapter (unload). No-op if not resident.
  void evict(const LoraAdapter* adapter);
  int slot_of(const LoraAdapter* adapter) const;  // -1 if not resident
  int used_slots() const;                          // slots with references
  int resident_slots() const;
  const LoraTables& tables() const { return tables_; }

 private:
  struct Slot {
    std::shared_ptr<const LoraAdapter> adapter;
    int refs = 0;
    uint64_t last_use = 0;
    std::vector<Tensor> uploaded;  // backend copies kept alive while resident
  };
  void place(int slot, const std::shared_ptr<const LoraAdapter>& adapter);
  void clear(int slot);

  const ModelConfig& cfg_;
  Backend& backend_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
  // Owned tables; tables_ holds pointers into them.
  std::vector<std::vector<std::unique_ptr<LoraModuleTable>>> dense_;  // [layer][target]
  std::vector<std::unique_ptr<MoeLoraTable>> experts_;                // [layer]
  LoraTables tables_;
};

}  // namespace moelora
