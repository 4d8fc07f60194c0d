// What differs between architectures in checkpoint and adapter names. Everything else (the
// forward pass) is shared and branches on ModelConfig fields.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/model_config.h"
#include "model/model_weights.h"

namespace moelora {

struct ArchNaming {
  // Module holding the MoE block inside a layer; the first that exists in the checkpoint wins
  // (Mixtral: "block_sparse_moe" on the hub, "mlp" in transformers 5 module names).
  std::vector<std::string> moe_blocks;
  std::array<std::string, 3> expert_proj;  // gate, up, down ("w1", "w3", "w2" for Mixtral)
  bool qk_norm = false;                    // Qwen3 per-head q_norm / k_norm
};

const ArchNaming& arch_naming(Arch arch);

// Where a PEFT module path ("model.layers.3.self_attn.q_proj") points in the model.
struct ModuleRef {
  enum class Kind { kDense, kExpert, kFusedExperts } kind = Kind::kDense;
  int layer = -1;
  LoraTarget target = LoraTarget::kQ;  // kDense
  int expert = -1;                     // kExpert
  int expert_proj = -1;                // kExpert: 0 gate, 1 up, 2 down
};

// Resolves a module path of the base model (without the "base_model.model." prefix). Returns
// nullopt when the path names no LoRA-capable linear of this model (the message says why).
std::optional<ModuleRef> resolve_module(const ModelConfig& cfg, std::string_view path, std::string* why);

// Input and output width of a dense LoRA target in `layer`; (0, 0) when the layer has no such
// projection (k_proj in an MLA model, a dense gate_proj in a MoE layer, ...).
std::pair<int, int> lora_target_shape(const ModelConfig& cfg, int layer, LoraTarget t);

}  // namespace moelora
