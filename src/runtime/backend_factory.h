// Creates a backend by name ("cpu", "cuda"); the CUDA one exists only in CUDA builds.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "ops/backend.h"

namespace moelora {

struct BackendOptions {
  std::string name = "cpu";
  bool cuda_graphs = true;     // CUDA: replay captured decode graphs
  bool cuda_overlap = true;    // CUDA: LoRA work on a side stream
  bool cuda_moe_fp8_activations = false;  // CUDA: FP8 experts may quantise activations (W8A8)
  bool cuda_dense_lora_in_gemm = true;    // CUDA: dense LoRA inside the small-M GEMM (decode)
  bool cuda_kv_write_in_head_pass = true;  // CUDA: the KV cache write inside the rotation's launch
  bool cuda_shared_experts_concurrent = false;  // CUDA: shared experts on their own stream
  bool cuda_moe_lora_beside_gemm = true;        // CUDA: MoE LoRA shrinks beside the grouped GEMMs
  bool cuda_dense_lora_beside_gemm = true;      // CUDA: dense LoRA shrinks beside the small-M GEMMs
};

Result<std::unique_ptr<Backend>> make_backend(const BackendOptions& opts);

}  // namespace moelora
