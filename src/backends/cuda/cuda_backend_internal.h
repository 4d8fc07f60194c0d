// Per-step state of CudaBackend shared by its two translation units.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <string>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels/lora_dense.cuh"
#include "backends/cuda/kernels/moe_forward.cuh"

namespace moelora {

struct CudaBackend::StepMeta {
  // Pinned staging for the packed upload, reused every step (the previous step's copy has
  // finished: every step ends with a synchronous logits read-back).
  int32_t* pinned = nullptr;
  size_t pinned_words = 0;
  size_t page_capacity = 0;  // page-table entries the fixed layout holds
  // Device copies of the StepBatch arrays (in the arena).
  const int32_t* token_ids = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* token_seq = nullptr;
  const int32_t* token_slot = nullptr;
  const int32_t* logit_rows = nullptr;
  const int32_t* page_indptr = nullptr;
  const int32_t* page_indices = nullptr;
  // LoRA plans of this step by (in, out, ranks of the slots): every layer reuses them.
  struct PlannedLora {
    cuda::LoraPlan plan;
    void* dev_meta = nullptr;
  };
  std::map<std::string, PlannedLora> lora_plans;
  // Plans outlive the per-layer scratch (they are reused by every layer), so their device copies
  // come from a region reserved at begin_step below every layer's mark.
  char* plan_region = nullptr;
  size_t plan_bytes = 0, plan_used = 0;
  void* plan_alloc(size_t bytes);
};

// Captured decode graphs by key (bucket, any adapter, LoRA rank ceiling); cuda_graphs.cu.
struct CudaBackend::Graphs {
  struct Entry {
    cudaGraphExec_t exec = nullptr;
    Tensor output;
    std::vector<LoraRecipe> recipes;
  };
  std::map<uint64_t, Entry> entries;
  std::map<uint64_t, int> seen;
  uint64_t key = 0;

  ~Graphs() { clear(); }
  void clear() {
    for (auto& [k, e] : entries)
      if (e.exec) cudaGraphExecDestroy(e.exec);
    entries.clear();
    seen.clear();
  }
};

}  // namespace moelora
