#include "model/model.h"

#include <algorithm>
#include <cmath>

#include "io/checkpoint.h"
#include "model/archs.h"
#include "model/forward_pass.h"
#include "model/fused_projections.h"
#include "model/weight_loader.h"

namespace moelora {

namespace {

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double yarn_correction_dim(double rotations, int dim, double base, int max_pos) {
  return (dim * std::log(max_pos / (rotations * 2.0 * M_PI))) / (2.0 * std::log(base));
}

}  // namespace

RopeTable make_rope_table(const ModelConfig& cfg) {
  const RopeConfig& r = cfg.rope;
  RopeTable t;
  t.rot_dim = r.rot_dim;
  t.interleaved = r.interleaved;
  const int dim = r.rot_dim, half = dim / 2;
  t.inv_freq.resize(half);
  // float32 as transformers: base ** (arange(0, dim, 2) / dim) in float32.
  for (int i = 0; i < half; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(dim);
    t.inv_freq[i] = 1.0f / std::pow(static_cast<float>(r.theta), expo);
  }
  if (r.type == "linear") {
    for (float& f : t.inv_freq) f = static_cast<float>(f / r.factor);
  } else if (r.type == "yarn") {
    const double factor = r.factor;
    if (r.attention_factor) {
      t.attention_factor = static_cast<float>(*r.attention_factor);
    } else if (r.mscale && r.mscale_all_dim && *r.mscale != 0 && *r.mscale_all_dim != 0) {
      t.attention_factor = static_cast<float>(yarn_get_mscale(factor, *r.mscale) /
                                              yarn_get_mscale(factor, *r.mscale_all_dim));
    } else {
      t.attention_factor = static_cast<float>(yarn_get_mscale(factor, 1.0));
    }
    double low = yarn_correction_dim(r.beta_fast, dim, r.theta, r.original_max_position_embeddings);
    double high = yarn_correction_dim(r.beta_slow, dim, r.theta, r.original_max_position_embeddings);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // avoid a zero-width ramp
    for (int i = 0; i < half; ++i) {
      const float extrapolation = t.inv_freq[i];
      const float interpolation = static_cast<float>(extrapolation / factor);
      float ramp = static_cast<float>((i - low) / (high - low));
      ramp = std::min(1.0f, std::max(0.0f, ramp));
      const float extrapolation_factor = 1.0f - ramp;
      t.inv_freq[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
  }
  return t;
}

ModelShapes model_shapes(const ModelConfig& cfg, bool mla_absorbed) {
  ModelShapes s;
  s.arch = cfg.model_type;
  s.num_layers = cfg.num_layers;
  s.hidden = cfg.hidden_size;
  s.vocab = cfg.vocab_size;
  s.heads = cfg.num_heads;
  s.kv_heads = cfg.attn_kv_heads();
  s.k_head_dim = cfg.attn_k_head_dim();
  s.v_head_dim = cfg.attn_v_head_dim();
  s.rope_dim = cfg.rope.rot_dim;
  s.rope_offset = cfg.is_mla() ? cfg.qk_nope_head_dim : 0;  // forward_pass rotates q after the nope dims
  if (cfg.is_mla()) {
    s.kv_lora_rank = cfg.kv_lora_rank;
    s.mla_absorbed = mla_absorbed;
  }
  const bool any_moe = std::find(cfg.layer_is_moe.begin(), cfg.layer_is_moe.end(), true) != cfg.layer_is_moe.end();
  if (any_moe) {
    s.num_experts = cfg.num_experts;
    s.top_k = cfg.top_k;
    s.moe_intermediate = cfg.moe_intermediate_size;
    s.grouped_router = cfg.router == RouterKind::kSigmoidGroupTopK;
    s.n_group = cfg.n_group;
    s.topk_group = cfg.topk_group;
  }
  s.weight_format = cfg.weight_format;
  // Every dense LoRA target of every layer (the slot pool allocates tables for all of them).
  for (int l = 0; l < cfg.num_layers; ++l)
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      const int in = lora_target_shape(cfg, l, target).first;
      if (in == 0) continue;
      const std::string name = lora_target_name(target);
      const bool seen = std::any_of(s.lora_inputs.begin(), s.lora_inputs.end(),
                                    [&](const ModelShapes::LoraInput& x) { return x.name == name && x.in == in; });
      if (!seen) s.lora_inputs.push_back({name, in});
    }
  return s;
}

const char* mla_mode_name(MlaMode m) {
  switch (m) {
    case MlaMode::kAuto: return "auto";
    case MlaMode::kDecompressed: return "decompressed";
    case MlaMode::kAbsorbed: return "absorbed";
  }
  return "?";
}

Result<MlaMode> parse_mla_mode(const std::string& text) {
  for (MlaMode m : {MlaMode::kAuto, MlaMode::kDecompressed, MlaMode::kAbsorbed})
    if (text == mla_mode_name(m)) return m;
  return invalid_argument("MLA mode '{}': expected auto, decompressed or absorbed", text);
}

KvShape kv_shape(const ModelConfig& cfg, bool mla_absorbed) {
  if (cfg.is_mla() && mla_absorbed) return {1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0};
  return {cfg.attn_kv_heads(), cfg.attn_k_head_dim(), cfg.attn_v_head_dim()};
}

Status Model::choose_mla_form(const ModelOptions& opts) {
  mla_absorbed_ = false;
  if (!cfg_.is_mla() || opts.mla == MlaMode::kDecompressed) return {};
  const bool can = backend_.supports_mla_absorbed();
  if (opts.mla == MlaMode::kAbsorbed && !can)
    return unsupported("MLA mode 'absorbed': the {} backend has no absorbed MLA attention (use auto or decompressed)",
                       backend_.name());
  mla_absorbed_ = can;
  return {};
}

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, Backend& backend, const ModelOptions& opts) {
  MOELORA_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(dir));
  std::unique_ptr<Model> m(new Model(cfg, dir, backend));
  // Before the checkpoint is read: a refusal costs nothing and names the limit. The MLA form comes
  // first, as the kernels that will run decide the limits.
  MOELORA_RETURN_IF_ERROR(m->choose_mla_form(opts).with_context(dir + ": "));
  MOELORA_RETURN_IF_ERROR(backend.check_model_shapes(m->shapes()).with_context(dir + ": "));
  MOELORA_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(dir));
  MOELORA_ASSIGN_OR_RETURN(m->weights_, load_model_weights(ck, cfg, backend, backend.derived_weight_bytes(m->shapes())));
  m->fuse_projections();
  m->rope_ = make_rope_table(cfg);
  return m;
}

// Host-memory backends keep the separate projections too: the sharded forward (src/parallel) cuts
// them per rank. A device gives their memory back.
void Model::fuse_projections() {
  moelora::fuse_projections(weights_, backend_, /*keep_parts=*/backend_.device() == Device::kCpu);
}

std::vector<KvLayer> Model::alloc_kv_cache(int num_pages, int page_size) const {
  const KvShape s = kv_shape();
  std::vector<KvLayer> kv;
  for (int l = 0; l < cfg_.num_layers; ++l)
    kv.push_back(backend_.alloc_kv_layer(num_pages, page_size, s.kv_heads, s.k_head_dim, s.v_head_dim));
  return kv;
}

Tensor Model::forward(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora) {
  return backend_.to_host_f32(forward_logits(batch, kv, lora));
}

Tensor Model::forward_logits(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora) {
  Backend& b = backend_;
  const StepBatch& step = b.begin_step(batch);  // possibly padded to a captured graph's size
  Tensor logits;
  if (b.step_mode() == Backend::StepMode::kReplay) {
    logits = b.step_output();
  } else {
    SingleDeviceContext single(cfg_);
    logits = forward_body({cfg_, weights_, rope_, b, single, mla_absorbed_}, step, kv, lora);
    b.end_step_body(logits);
  }
  // Padding rows (if any) come after the real ones.
  return logits.slice_rows(0, static_cast<int64_t>(batch.logit_rows.size()));
}

}  // namespace moelora
