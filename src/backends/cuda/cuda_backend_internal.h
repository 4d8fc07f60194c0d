// Per-step state of CudaBackend shared by its two translation units.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_check.h"
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
  // Pinned staging of the plans a replayed graph reads (CudaBackend::replan_lora).
  char* plan_pinned = nullptr;
  size_t plan_pinned_bytes = 0;
  void* plan_alloc(size_t bytes);
};

// A device buffer and its pinned host twin, grown to the largest size asked for.
struct StagedBuffer {
  void* dev = nullptr;
  void* host = nullptr;
  size_t bytes = 0;
  void reserve(size_t n) {
    if (n <= bytes) return;
    release();
    bytes = std::max(n, bytes * 2);
    MOELORA_CUDA_CHECK(cudaMalloc(&dev, bytes));
    MOELORA_CUDA_CHECK(cudaMallocHost(&host, bytes));
  }
  void release() {
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
    dev = host = nullptr;
    bytes = 0;
  }
  StagedBuffer() = default;
  StagedBuffer(const StagedBuffer&) = delete;
  StagedBuffer& operator=(const StagedBuffer&) = delete;
  ~StagedBuffer() { release(); }
};

// Sampling buffers (cuda_sampler.cu).
struct CudaBackend::Sampler {
  StagedBuffer in, out;
  float* processed = nullptr;
  size_t processed_bytes = 0;
  std::array<int, 5> max_active_clusters{};  // of the sampling kernel, asked once (cuda_plan input)
  bool clusters_known = false;
  // Penalty slots (ops/sampling.h): [slots, vocab] cells on the device. penalty_reset only queues
  // its slot and tokens here; the next sample() applies every queued reset in one upload (its
  // pinned staging is then free again once sample() has waited for the stream).
  uint32_t* penalty_cells = nullptr;
  int penalty_slots = 0, penalty_vocab = 0;
  std::vector<int> reset_slots;
  std::vector<int32_t> reset_tokens, reset_slot_gen;  // token, (slot << 1) | generated
  StagedBuffer reset;
  ~Sampler() {
    if (processed) cudaFree(processed);
    if (penalty_cells) cudaFree(penalty_cells);
  }
  float* processed_rows(size_t bytes) {
    if (bytes > processed_bytes) {
      if (processed) MOELORA_CUDA_CHECK(cudaFree(processed));
      processed_bytes = std::max(bytes, processed_bytes * 2);
      MOELORA_CUDA_CHECK(cudaMalloc(&processed, processed_bytes));
    }
    return processed;
  }
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
