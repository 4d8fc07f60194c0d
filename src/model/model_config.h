// ModelConfig: everything the engine needs from a Hugging Face config.json, in one typed struct.
// Accepts both the hub spellings and the transformers-5 spellings (rope_parameters, dtype,
// num_local_experts for Qwen3-MoE).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/json_util.h"
#include "ops/weight_format.h"

namespace moelora {

enum class Arch { kQwen3Moe, kMixtral, kDeepseekV3 };
const char* arch_name(Arch a);

enum class RouterKind {
  kSoftmaxTopK,       // Qwen3-MoE, Mixtral: softmax over experts, top-k, optional renormalisation
  kSigmoidGroupTopK,  // DeepSeek-V3: sigmoid, +bias for selection only, group-limited, x scaling
};

struct RopeConfig {
  std::string type = "default";  // "default" | "yarn" | "linear"
  double theta = 10000.0;
  int rot_dim = 0;               // dimensions rotated per head
  bool interleaved = false;      // DeepSeek rope_interleave: rotate adjacent pairs
  // YaRN / linear scaling.
  double factor = 1.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<double> attention_factor;
  int original_max_position_embeddings = 0;
  bool truncate = true;
};

struct ModelConfig {
  Arch arch = Arch::kQwen3Moe;
  std::string model_type;
  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // GQA head dim (Qwen3, Mixtral)
  double rms_norm_eps = 1e-6;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  RopeConfig rope;

  // Dense MLP (DeepSeek first layers, Qwen3 mlp_only_layers).
  int intermediate_size = 0;

  // MoE.
  RouterKind router = RouterKind::kSoftmaxTopK;
  int num_experts = 0;
  int top_k = 0;
  int moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  std::vector<bool> layer_is_moe;  // per layer
  int n_shared_experts = 0;        // DeepSeek: one shared MLP of width n * moe_intermediate
  int n_group = 1;
  int topk_group = 1;
  double routed_scaling_factor = 1.0;

  // MLA (DeepSeek-V3). q_lora_rank == 0 means a plain q_proj.
  int q_lora_rank = 0;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;

  // Quantisation declared by quantization_config (or ModelOpt's hf_quant_config.json): FP8 block
  // scales or NVFP4. Which tensors are quantised is decided by the files (their dtype), as in the
  // exports; `quant_exclude` (ModelOpt's exclude_modules / ignore, glob patterns) is checked against
  // them. Dense when nothing is declared.
  WeightFormat weight_format;
  std::vector<std::string> quant_exclude;
  // True when `module` ("model.layers.0.self_attn.q_proj") matches an exclude pattern, exactly, as
  // a glob, or as one of its parents ("re:" regex patterns are skipped).
  bool quant_excluded(const std::string& module) const;

  std::vector<int> eos_token_ids;
  std::optional<int> bos_token_id;

  bool is_mla() const { return arch == Arch::kDeepseekV3; }
  // Per-head widths of the attention K and V the engine caches.
  int attn_k_head_dim() const { return is_mla() ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  int attn_v_head_dim() const { return is_mla() ? v_head_dim : head_dim; }
  int attn_kv_heads() const { return is_mla() ? num_heads : num_kv_heads; }
  // Softmax scale of attention logits (includes DeepSeek's YaRN mscale^2).
  double attention_scale() const;
};

// Parses config.json text. `what` names the file in messages.
Result<ModelConfig> parse_model_config(const std::string& text, const std::string& what);
// Applies a ModelOpt quantisation description (hf_quant_config.json's "quantization" object, or a
// config.json quantization_config with quant_method "modelopt") to `c`.
Status apply_modelopt_quantization(const Json& q, const std::string& what, ModelConfig& c);
// Applies a compressed-tensors quantization_config (llm-compressor's nvfp4-pack-quantized) to `c`.
Status apply_compressed_tensors_quantization(const Json& q, const std::string& what, ModelConfig& c);
// Reads <dir>/config.json (and eos ids from generation_config.json, ModelOpt's hf_quant_config.json
// when present).
Result<ModelConfig> load_model_config(const std::string& dir);

}  // namespace moelora
