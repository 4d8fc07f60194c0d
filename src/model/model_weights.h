// The weights of a model on a backend, and the per-layer LoRA tables the forward pass reads.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "ops/types.h"

namespace moelora {

// Dense projections of a decoder layer that LoRA can target. Routed experts are separate
// (MoeLoraTable), since they are indexed by (slot, expert).
enum class LoraTarget : uint8_t {
  kQ, kK, kV, kO,              // GQA attention (kQ is also MLA's q_proj when q_lora_rank == 0)
  kQA, kQB, kKVA, kKVB,        // MLA attention
  kGate, kUp, kDown,           // dense MLP
  kSharedGate, kSharedUp, kSharedDown,  // shared experts
  kCount
};
constexpr int kNumLoraTargets = static_cast<int>(LoraTarget::kCount);
const char* lora_target_name(LoraTarget t);

struct AttentionWeights {
  LinearWeight q, k, v, o;
  LinearWeight qkv;             // q|k|v rows fused (fuse_projections); undefined = separate
  Tensor q_norm, k_norm;        // Qwen3 per-head RMSNorm
  LinearWeight q_a, q_b, kv_a, kv_b;  // MLA
  LinearWeight q_a_kv_a;              // MLA: q_a|kv_a rows fused (both read the layer's input)
  Tensor q_a_norm, kv_a_norm;
};

struct MlpWeights {
  LinearWeight gate, up, down;
  LinearWeight gate_up;  // gate|up rows fused (fuse_projections); undefined = separate
};

struct LayerWeights {
  Tensor input_norm;
  Tensor post_attention_norm;
  AttentionWeights attn;
  bool is_moe = false;
  MlpWeights mlp;            // dense layers
  LinearWeight router;       // MoE layers: [E, H]
  Tensor router_bias;        // DeepSeek e_score_correction_bias [E] (selection only)
  ExpertWeights experts;
  bool has_shared = false;
  MlpWeights shared;         // DeepSeek shared experts
};

struct ModelWeights {
  Tensor embed;              // [vocab, H]
  std::vector<LayerWeights> layers;
  Tensor final_norm;
  LinearWeight lm_head;      // [vocab, H]
};

// What the forward pass reads for LoRA: per layer, one table per dense target (nullptr where no
// loaded adapter targets it) and one for the routed experts.
struct LayerLoraTables {
  std::array<const LoraModuleTable*, kNumLoraTargets> dense{};
  const MoeLoraTable* experts = nullptr;
  const LoraModuleTable* get(LoraTarget t) const { return dense[static_cast<int>(t)]; }
};
using LoraTables = std::vector<LayerLoraTables>;

}  // namespace moelora
