// The shapes of a model (and of the adapters it will serve) that decide whether a backend's
// kernels can run it, as plain numbers. Backend::check_model_shapes reads them before any weight
// is loaded, so a model a kernel cannot take is refused with a message instead of aborting in
// the middle of a forward pass. src/model builds them from a ModelConfig (model_shapes()); they
// live here, below the backends, so that the dependency stays one-way (ops <- backends <- model).
#pragma once

#include <string>
#include <vector>

#include "ops/weight_format.h"

namespace moelora {

struct ModelShapes {
  std::string arch;  // for messages ("qwen3_moe", ...)
  int num_layers = 0;
  int hidden = 0;
  int vocab = 0;
  // Attention as the decompressed KV cache holds it (MLA: per-head K and V of nope + rope / v_dim
  // values; these limits concern MLA only when it runs decompressed, see mla_absorbed).
  int heads = 0;
  int kv_heads = 0;
  int k_head_dim = 0;
  int v_head_dim = 0;
  // Rotary embedding: rope_dim dims rotated at rope_offset inside each query head of k_head_dim
  // (MLA: after the qk_nope dims).
  int rope_dim = 0;
  int rope_offset = 0;
  // MLA (DeepSeek; kv_lora_rank 0 = none): the latent width, and whether the model runs the absorbed
  // form (Model decides the form before this check, so a backend judges the kernels that will run:
  // the latent attention's instead of the per-head attention's).
  int kv_lora_rank = 0;
  bool mla_absorbed = false;
  // Routed experts (num_experts 0: the model has no MoE layer).
  int num_experts = 0;
  int top_k = 0;
  int moe_intermediate = 0;
  bool grouped_router = false;  // DeepSeek-V3: sigmoid, group-limited top-k
  int n_group = 1;
  int topk_group = 1;
  // How the checkpoint declares its quantised weights (dense: none).
  WeightFormat weight_format;
  // Every dense projection an adapter may target (each name once per distinct width) and its
  // input width: the K of the LoRA shrink.
  struct LoraInput {
    std::string name;
    int in = 0;
  };
  std::vector<LoraInput> lora_inputs;
  // Adapter capacity: slots on the backend and the largest rank that will be placed in one.
  // 0 = not known yet (model load); Engine::create checks again with its options.
  int lora_slots = 0;
  int max_lora_rank = 0;
};

}  // namespace moelora
