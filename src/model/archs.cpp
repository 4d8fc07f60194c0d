#include "model/archs.h"

#include <charconv>

namespace moelora {

const char* lora_target_name(LoraTarget t) {
  switch (t) {
    case LoraTarget::kQ: return "q_proj";
    case LoraTarget::kK: return "k_proj";
    case LoraTarget::kV: return "v_proj";
    case LoraTarget::kO: return "o_proj";
    case LoraTarget::kQA: return "q_a_proj";
    case LoraTarget::kQB: return "q_b_proj";
    case LoraTarget::kKVA: return "kv_a_proj_with_mqa";
    case LoraTarget::kKVB: return "kv_b_proj";
    case LoraTarget::kGate: return "mlp.gate_proj";
    case LoraTarget::kUp: return "mlp.up_proj";
    case LoraTarget::kDown: return "mlp.down_proj";
    case LoraTarget::kSharedGate: return "shared_experts.gate_proj";
    case LoraTarget::kSharedUp: return "shared_experts.up_proj";
    case LoraTarget::kSharedDown: return "shared_experts.down_proj";
    case LoraTarget::kCount: break;
  }
  return "?";
}

const ArchNaming& arch_naming(Arch arch) {
  static const ArchNaming qwen{{"mlp"}, {"gate_proj", "up_proj", "down_proj"}, true};
  static const ArchNaming mixtral{{"block_sparse_moe", "mlp"}, {"w1", "w3", "w2"}, false};
  static const ArchNaming deepseek{{"mlp"}, {"gate_proj", "up_proj", "down_proj"}, false};
  switch (arch) {
    case Arch::kQwen3Moe: return qwen;
    case Arch::kMixtral: return mixtral;
    case Arch::kDeepseekV3: return deepseek;
  }
  return qwen;
}

namespace {

bool consume(std::string_view& s, std::string_view prefix) {
  if (s.substr(0, prefix.size()) != prefix) return false;
  s.remove_prefix(prefix.size());
  return true;
}

bool consume_int(std::string_view& s, int* out) {
  size_t n = 0;
  while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0 || n > 9) return false;
  std::from_chars(s.data(), s.data() + n, *out);
  s.remove_prefix(n);
  return true;
}

std::optional<LoraTarget> attention_target(const ModelConfig& cfg, std::string_view name) {
  if (!cfg.is_mla()) {
    if (name == "q_proj") return LoraTarget::kQ;
    if (name == "k_proj") return LoraTarget::kK;
    if (name == "v_proj") return LoraTarget::kV;
    if (name == "o_proj") return LoraTarget::kO;
    return std::nullopt;
  }
  if (name == "o_proj") return LoraTarget::kO;
  if (name == "kv_a_proj_with_mqa") return LoraTarget::kKVA;
  if (name == "kv_b_proj") return LoraTarget::kKVB;
  if (cfg.q_lora_rank > 0) {
    if (name == "q_a_proj") return LoraTarget::kQA;
    if (name == "q_b_proj") return LoraTarget::kQB;
  } else if (name == "q_proj") {
    return LoraTarget::kQ;
  }
  return std::nullopt;
}

}  // namespace

std::optional<ModuleRef> resolve_module(const ModelConfig& cfg, std::string_view path, std::string* why) {
  std::string_view s = path;
  ModuleRef ref;
  if (!consume(s, "model.layers.") || !consume_int(s, &ref.layer) || !consume(s, ".")) {
    *why = "it is not inside a decoder layer (embedding and lm_head LoRA are not supported)";
    return std::nullopt;
  }
  if (ref.layer >= cfg.num_layers) {
    *why = "layer " + std::to_string(ref.layer) + " does not exist (the model has " +
           std::to_string(cfg.num_layers) + ")";
    return std::nullopt;
  }
  const bool moe = cfg.layer_is_moe[ref.layer];
  if (consume(s, "self_attn.")) {
    if (auto t = attention_target(cfg, s)) {
      ref.target = *t;
      return ref;
    }
    *why = "the attention of this model has no projection named '" + std::string(s) + "'";
    return std::nullopt;
  }
  const ArchNaming& nm = arch_naming(cfg.arch);
  for (const std::string& block : nm.moe_blocks) {
    std::string_view r = s;
    if (!consume(r, block) || !consume(r, ".")) continue;
    if (!moe) {
      if (r == "gate_proj") ref.target = LoraTarget::kGate;
      else if (r == "up_proj") ref.target = LoraTarget::kUp;
      else if (r == "down_proj") ref.target = LoraTarget::kDown;
      else break;
      return ref;
    }
    if (r == "experts") {
      ref.kind = ModuleRef::Kind::kFusedExperts;
      return ref;
    }
    if (consume(r, "shared_experts.")) {
      if (cfg.n_shared_experts == 0) break;
      if (r == "gate_proj") ref.target = LoraTarget::kSharedGate;
      else if (r == "up_proj") ref.target = LoraTarget::kSharedUp;
      else if (r == "down_proj") ref.target = LoraTarget::kSharedDown;
      else break;
      return ref;
    }
    if (consume(r, "experts.") && consume_int(r, &ref.expert) && consume(r, ".")) {
      if (ref.expert >= cfg.num_experts) {
        *why = "expert " + std::to_string(ref.expert) + " does not exist (the layer has " +
               std::to_string(cfg.num_experts) + ")";
        return std::nullopt;
      }
      ref.kind = ModuleRef::Kind::kExpert;
      // Accept both the architecture's own names and the gate/up/down spelling.
      static const std::array<std::string_view, 3> generic{"gate_proj", "up_proj", "down_proj"};
      for (int p = 0; p < 3; ++p)
        if (r == nm.expert_proj[p] || r == generic[p]) ref.expert_proj = p;
      if (ref.expert_proj >= 0) return ref;
      break;
    }
    if (r == "gate") {
      *why = "LoRA on the MoE router is not supported";
      return std::nullopt;
    }
    break;
  }
  *why = "layer " + std::to_string(ref.layer) + " of this model has no LoRA-capable module '" +
         std::string(s) + "'";
  return std::nullopt;
}

std::pair<int, int> lora_target_shape(const ModelConfig& c, int layer, LoraTarget t) {
  const int H = c.hidden_size;
  const bool moe = c.layer_is_moe[layer];
  const bool mla = c.is_mla();
  const int q_width = c.num_heads * (mla ? c.qk_nope_head_dim + c.qk_rope_head_dim : c.head_dim);
  const int shared = moe ? c.moe_intermediate_size * c.n_shared_experts : 0;
  switch (t) {
    case LoraTarget::kQ: return (!mla || c.q_lora_rank == 0) ? std::pair{H, q_width} : std::pair{0, 0};
    case LoraTarget::kK:
    case LoraTarget::kV: return mla ? std::pair{0, 0} : std::pair{H, c.num_kv_heads * c.head_dim};
    case LoraTarget::kO: return {c.num_heads * c.attn_v_head_dim(), H};
    case LoraTarget::kQA: return mla && c.q_lora_rank > 0 ? std::pair{H, c.q_lora_rank} : std::pair{0, 0};
    case LoraTarget::kQB: return mla && c.q_lora_rank > 0 ? std::pair{c.q_lora_rank, q_width} : std::pair{0, 0};
    case LoraTarget::kKVA: return mla ? std::pair{H, c.kv_lora_rank + c.qk_rope_head_dim} : std::pair{0, 0};
    case LoraTarget::kKVB:
      return mla ? std::pair{c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)} : std::pair{0, 0};
    case LoraTarget::kGate:
    case LoraTarget::kUp: return moe ? std::pair{0, 0} : std::pair{H, c.intermediate_size};
    case LoraTarget::kDown: return moe ? std::pair{0, 0} : std::pair{c.intermediate_size, H};
    case LoraTarget::kSharedGate:
    case LoraTarget::kSharedUp: return shared ? std::pair{H, shared} : std::pair{0, 0};
    case LoraTarget::kSharedDown: return shared ? std::pair{shared, H} : std::pair{0, 0};
    case LoraTarget::kCount: break;
  }
  return {0, 0};
}

}  // namespace moelora
