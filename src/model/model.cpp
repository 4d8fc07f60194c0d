#include "model/model.h"

#include <cmath>

#include "io/checkpoint.h"
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

Result<std::unique_ptr<Model>> Model::load(const std::string& dir, Backend& backend) {
  MOELORA_ASSIGN_OR_RETURN(ModelConfig cfg, load_model_config(dir));
  MOELORA_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::open(dir));
  std::unique_ptr<Model> m(new Model(cfg, dir, backend));
  MOELORA_ASSIGN_OR_RETURN(m->weights_, load_model_weights(ck, cfg, backend));
  m->rope_ = make_rope_table(cfg);
  return m;
}

std::vector<KvLayer> Model::alloc_kv_cache(int num_pages, int page_size) const {
  std::vector<KvLayer> kv;
  for (int l = 0; l < cfg_.num_layers; ++l)
    kv.push_back(backend_.alloc_kv_layer(num_pages, page_size, cfg_.attn_kv_heads(), cfg_.attn_k_head_dim(),
                                         cfg_.attn_v_head_dim()));
  return kv;
}

Tensor Model::forward(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora) {
  Backend& b = backend_;
  const StepBatch& step = b.begin_step(batch);  // possibly padded to a captured graph's size
  Tensor logits;
  if (b.step_mode() == Backend::StepMode::kReplay) {
    logits = b.step_output();
  } else {
    logits = forward_body(step, kv, lora);
    b.end_step_body(logits);
  }
  // Padding rows (if any) come after the real ones.
  return b.to_host_f32(logits.slice_rows(0, static_cast<int64_t>(batch.logit_rows.size())));
}

Tensor Model::forward_body(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora) {
  Backend& b = backend_;
  const int T = batch.num_tokens();
  Tensor h = b.alloc_act(T, cfg_.hidden_size);
  b.embed(weights_.embed, h);
  Tensor x = b.alloc_act(T, cfg_.hidden_size);
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    const LayerLoraTables* ll = lora ? &(*lora)[l] : nullptr;
    const size_t mark = b.scratch_mark();  // this layer's scratch is given back at its end
    b.rmsnorm(h, lw.input_norm, eps, x);
    Tensor a = cfg_.is_mla() ? attention_mla(l, x, kv[l], ll) : attention_gqa(l, x, kv[l], ll);
    b.add(a, h);
    b.rmsnorm(h, lw.post_attention_norm, eps, x);
    Tensor m = lw.is_moe ? moe(l, x, ll) : mlp(lw.mlp, x, ll, false);
    b.add(m, h);
    b.scratch_release(mark);
  }
  const int R = static_cast<int>(batch.logit_rows.size());
  Tensor rows = b.alloc_act(R, cfg_.hidden_size);
  b.gather_logit_rows(h, rows);
  b.rmsnorm(rows, weights_.final_norm, eps, rows);
  Tensor logits = b.alloc(R, cfg_.vocab_size, DType::kF32);
  b.linear(rows, weights_.lm_head, nullptr, logits);
  return logits;
}

Tensor Model::attention_gqa(int layer, const Tensor& x, KvLayer& kv, const LayerLoraTables* lora) {
  Backend& b = backend_;
  const AttentionWeights& w = weights_.layers[layer].attn;
  const int T = static_cast<int>(x.rows()), d = cfg_.head_dim;
  auto tab = [&](LoraTarget t) { return lora ? lora->get(t) : nullptr; };
  Tensor q = b.alloc_act(T, cfg_.num_heads * d);
  Tensor k = b.alloc_act(T, cfg_.num_kv_heads * d);
  Tensor v = b.alloc_act(T, cfg_.num_kv_heads * d);
  b.linear(x, w.q, tab(LoraTarget::kQ), q);
  b.linear(x, w.k, tab(LoraTarget::kK), k);
  b.linear(x, w.v, tab(LoraTarget::kV), v);
  if (w.q_norm.defined()) {
    const float eps = static_cast<float>(cfg_.rms_norm_eps);
    b.rmsnorm(q, w.q_norm, eps, q);
    b.rmsnorm(k, w.k_norm, eps, k);
  }
  b.rope(q, cfg_.num_heads, d, 0, rope_);
  b.rope(k, cfg_.num_kv_heads, d, 0, rope_);
  Tensor attn = b.alloc_act(T, cfg_.num_heads * d);
  b.attention(q, k, v, kv, cfg_.num_heads, static_cast<float>(cfg_.attention_scale()), attn);
  Tensor out = b.alloc_act(T, cfg_.hidden_size);
  b.linear(attn, w.o, tab(LoraTarget::kO), out);
  return out;
}

Tensor Model::attention_mla(int layer, const Tensor& x, KvLayer& kv, const LayerLoraTables* lora) {
  Backend& b = backend_;
  const AttentionWeights& w = weights_.layers[layer].attn;
  const ModelConfig& c = cfg_;
  const int T = static_cast<int>(x.rows());
  const int nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope;
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto tab = [&](LoraTarget t) { return lora ? lora->get(t) : nullptr; };
  Tensor q = b.alloc_act(T, c.num_heads * qk);
  if (c.q_lora_rank > 0) {
    Tensor qa = b.alloc_act(T, c.q_lora_rank);
    b.linear(x, w.q_a, tab(LoraTarget::kQA), qa);
    b.rmsnorm(qa, w.q_a_norm, eps, qa);
    b.linear(qa, w.q_b, tab(LoraTarget::kQB), q);
  } else {
    b.linear(x, w.q, tab(LoraTarget::kQ), q);
  }
  Tensor ckv = b.alloc_act(T, c.kv_lora_rank + rope);
  b.linear(x, w.kv_a, tab(LoraTarget::kKVA), ckv);
  Tensor latent = b.alloc_act(T, c.kv_lora_rank);
  b.rmsnorm(ckv.slice_cols(0, c.kv_lora_rank), w.kv_a_norm, eps, latent);
  Tensor k_pe = ckv.slice_cols(c.kv_lora_rank, rope);
  b.rope(k_pe, 1, rope, 0, rope_);
  b.rope(q, c.num_heads, qk, nope, rope_);
  Tensor kvb = b.alloc_act(T, c.num_heads * (nope + c.v_head_dim));
  b.linear(latent, w.kv_b, tab(LoraTarget::kKVB), kvb);
  Tensor k = b.alloc_act(T, c.num_heads * qk);
  Tensor v = b.alloc_act(T, c.num_heads * c.v_head_dim);
  b.mla_split_kv(kvb, k_pe, c.num_heads, nope, c.v_head_dim, k, v);
  Tensor attn = b.alloc_act(T, c.num_heads * c.v_head_dim);
  b.attention(q, k, v, kv, c.num_heads, static_cast<float>(c.attention_scale()), attn);
  Tensor out = b.alloc_act(T, c.hidden_size);
  b.linear(attn, w.o, tab(LoraTarget::kO), out);
  return out;
}

Tensor Model::mlp(const MlpWeights& w, const Tensor& x, const LayerLoraTables* lora, bool shared) {
  Backend& b = backend_;
  const int T = static_cast<int>(x.rows()), inter = w.gate.out;
  auto tab = [&](LoraTarget dense, LoraTarget sh) { return lora ? lora->get(shared ? sh : dense) : nullptr; };
  Tensor g = b.alloc_act(T, inter), u = b.alloc_act(T, inter);
  b.linear(x, w.gate, tab(LoraTarget::kGate, LoraTarget::kSharedGate), g);
  b.linear(x, w.up, tab(LoraTarget::kUp, LoraTarget::kSharedUp), u);
  b.silu_mul(g, u, g);
  Tensor out = b.alloc_act(T, cfg_.hidden_size);
  b.linear(g, w.down, tab(LoraTarget::kDown, LoraTarget::kSharedDown), out);
  return out;
}

Tensor Model::moe(int layer, const Tensor& x, const LayerLoraTables* lora) {
  Backend& b = backend_;
  const LayerWeights& lw = weights_.layers[layer];
  const int T = static_cast<int>(x.rows()), E = cfg_.num_experts, k = cfg_.top_k;
  Tensor logits = b.alloc(T, E, DType::kF32);
  b.router_logits(x, lw.router, logits);
  Tensor ids = b.alloc(T, k, DType::kI32);
  Tensor weights = b.alloc(T, k, DType::kF32);
  if (cfg_.router == RouterKind::kSigmoidGroupTopK) {
    b.topk_sigmoid_grouped(logits, lw.router_bias, k, cfg_.n_group, cfg_.topk_group, cfg_.norm_topk_prob,
                           static_cast<float>(cfg_.routed_scaling_factor), ids, weights);
  } else {
    b.topk_softmax(logits, k, cfg_.norm_topk_prob, ids, weights);
  }
  Tensor out = b.alloc_act(T, cfg_.hidden_size);
  b.moe(x, ids, weights, lw.experts, lora ? lora->experts : nullptr, out);
  if (lw.has_shared) b.add(mlp(lw.shared, x, lora, true), out);
  return out;
}

}  // namespace moelora
