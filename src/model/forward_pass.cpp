#include "model/forward_pass.h"

#include "core/check.h"

namespace moelora {

namespace {

// One step's pass over the layers. Head counts are the rank's (par); every other shape is the
// model's or is read off the weights this rank holds, so no branch here knows about ranks.
class Body {
 public:
  Body(const ForwardModel& m, const LoraTables* lora)
      : c_(m.cfg), w_(m.weights), rope_(m.rope), b_(m.backend), par_(m.par), lora_(lora), absorbed_(m.mla_absorbed) {}

  Tensor run(const StepBatch& step, std::vector<KvLayer>& kv) {
    const int T = step.num_tokens();
    Tensor h = b_.alloc_act(T, c_.hidden_size);
    par_.embed(b_, step, w_.embed, h);
    Tensor x = b_.alloc_act(T, c_.hidden_size);
    const float eps = static_cast<float>(c_.rms_norm_eps);
    // Each residual add is fused with the norm that follows it (Backend::add_rmsnorm): the
    // attention output's with post_attention_norm, the MLP output's with the next layer's
    // input_norm, so x already holds a layer's normed input when the layer starts.
    if (c_.num_layers > 0) b_.rmsnorm(h, w_.layers[0].input_norm, eps, x);
    for (int l = 0; l < c_.num_layers; ++l) {
      const LayerWeights& lw = w_.layers[l];
      layer_lora_ = lora_ ? &(*lora_)[l] : nullptr;
      const size_t mark = b_.scratch_mark();  // this layer's scratch is given back at its end
      Tensor a = c_.is_mla() ? attention_mla(lw.attn, x, kv[l]) : attention_gqa(lw.attn, x, kv[l]);
      b_.add_rmsnorm(a, h, lw.post_attention_norm, eps, x);
      Tensor m = lw.is_moe ? moe(lw, x) : dense_mlp(lw.mlp, x);
      if (l + 1 < c_.num_layers)
        b_.add_rmsnorm(m, h, w_.layers[l + 1].input_norm, eps, x);
      else
        b_.add(m, h);  // the last layer's: the final norm runs on the logit rows only
      b_.scratch_release(mark);
    }
    const int R = static_cast<int>(step.logit_rows.size());
    Tensor rows = b_.alloc_act(R, c_.hidden_size);
    b_.gather_logit_rows(h, rows);
    b_.rmsnorm(rows, w_.final_norm, eps, rows);
    Tensor logits = b_.alloc(R, c_.vocab_size, DType::kF32);
    par_.logits(b_, rows, w_.lm_head, logits);
    return logits;
  }

  Tensor moe_of_layer(int l, const Tensor& x) {
    const LayerWeights& lw = w_.layers[l];
    MOELORA_CHECK_MSG(lw.is_moe, "layer {} is not a MoE layer", l);
    layer_lora_ = lora_ ? &(*lora_)[l] : nullptr;
    return moe(lw, x);
  }

  Tensor attention_of_layer(int l, const Tensor& x, KvLayer& kv) {
    const LayerWeights& lw = w_.layers[l];
    layer_lora_ = lora_ ? &(*lora_)[l] : nullptr;
    return c_.is_mla() ? attention_mla(lw.attn, x, kv) : attention_gqa(lw.attn, x, kv);
  }

 private:
  const LoraModuleTable* tab(LoraTarget t) const { return layer_lora_ ? layer_lora_->get(t) : nullptr; }

  // q/k/v are column-parallel by heads (the rank's heads), o_proj row-parallel.
  Tensor attention_gqa(const AttentionWeights& w, const Tensor& x, KvLayer& kv) {
    const int T = static_cast<int>(x.rows()), d = c_.head_dim;
    const int heads = par_.num_heads(), kv_heads = par_.num_kv_heads();
    const int qn = heads * d, kn = kv_heads * d;
    Tensor q, k, v, q_and_k;
    if (w.qkv.defined()) {  // one GEMM; q, k, v are column slices of its output
      Tensor qkv = b_.alloc_act(T, qn + 2 * kn);
      b_.linear_parts(x, w.qkv,
                      {{0, qn, tab(LoraTarget::kQ)}, {qn, kn, tab(LoraTarget::kK)}, {qn + kn, kn, tab(LoraTarget::kV)}},
                      qkv);
      q = qkv.slice_cols(0, qn);
      k = qkv.slice_cols(qn, kn);
      v = qkv.slice_cols(qn + kn, kn);
      q_and_k = qkv.slice_cols(0, qn + kn);
    } else {
      q = b_.alloc_act(T, qn);
      k = b_.alloc_act(T, kn);
      v = b_.alloc_act(T, kn);
      b_.linear(x, w.q, tab(LoraTarget::kQ), q);
      b_.linear(x, w.k, tab(LoraTarget::kK), k);
      b_.linear(x, w.v, tab(LoraTarget::kV), v);
    }
    const float eps = static_cast<float>(c_.rms_norm_eps);
    const float scale = static_cast<float>(c_.attention_scale());
    Tensor attn = b_.alloc_act(T, heads * d);
    if (q_and_k.defined()) {  // fused q|k: (Qwen3's norms,) one rotation and attention in one call
      b_.rotary_attention(q_and_k, v, heads, kv_heads, d, w.q_norm, w.k_norm, eps, rope_, kv, scale, attn);
      return project_out(w, attn);
    }
    if (w.q_norm.defined()) {
      b_.rmsnorm(q, w.q_norm, eps, q);
      b_.rmsnorm(k, w.k_norm, eps, k);
    }
    b_.rope(q, heads, d, 0, rope_);
    b_.rope(k, kv_heads, d, 0, rope_);
    b_.attention(q, k, v, kv, heads, scale, attn);
    return project_out(w, attn);
  }

  Tensor project_out(const AttentionWeights& w, const Tensor& attn) {
    Tensor out = b_.alloc_act(attn.rows(), c_.hidden_size);
    par_.row_linear(b_, attn, w.o, tab(LoraTarget::kO), out);
    return out;
  }

  // MLA: q_a / kv_a and their norms are whole on every rank (shared by all heads); q_b (or q) and
  // kv_b hold the rank's heads; o_proj is row-parallel. The absorbed form needs no collective
  // either: the latent is the same on every rank (each caches all of it) and kv_b's rows, like
  // its LoRA B rows, are the rank's heads.
  Tensor attention_mla(const AttentionWeights& w, const Tensor& x, KvLayer& kv) {
    const int T = static_cast<int>(x.rows()), heads = par_.num_heads();
    const int nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, qk = nope + rope;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    const int ckv_width = c_.kv_lora_rank + rope;
    Tensor q = b_.alloc_act(T, heads * qk);
    Tensor ckv;
    if (c_.q_lora_rank > 0) {
      Tensor qa;
      if (w.q_a_kv_a.defined()) {  // one GEMM; q_a's and kv_a's outputs are column slices of it
        Tensor both = b_.alloc_act(T, c_.q_lora_rank + ckv_width);
        b_.linear_parts(x, w.q_a_kv_a,
                        {{0, c_.q_lora_rank, tab(LoraTarget::kQA)}, {c_.q_lora_rank, ckv_width, tab(LoraTarget::kKVA)}},
                        both);
        qa = both.slice_cols(0, c_.q_lora_rank);
        ckv = both.slice_cols(c_.q_lora_rank, ckv_width);
      } else {
        qa = b_.alloc_act(T, c_.q_lora_rank);
        b_.linear(x, w.q_a, tab(LoraTarget::kQA), qa);
      }
      b_.rmsnorm(qa, w.q_a_norm, eps, qa);
      b_.linear(qa, w.q_b, tab(LoraTarget::kQB), q);
    } else {
      b_.linear(x, w.q, tab(LoraTarget::kQ), q);
    }
    if (!ckv.defined()) {
      ckv = b_.alloc_act(T, ckv_width);
      b_.linear(x, w.kv_a, tab(LoraTarget::kKVA), ckv);
    }
    Tensor latent = b_.alloc_act(T, c_.kv_lora_rank);
    b_.rmsnorm(ckv.slice_cols(0, c_.kv_lora_rank), w.kv_a_norm, eps, latent);
    Tensor k_pe = ckv.slice_cols(c_.kv_lora_rank, rope);
    b_.rope(k_pe, 1, rope, 0, rope_);
    b_.rope(q, heads, qk, nope, rope_);
    const float scale = static_cast<float>(c_.attention_scale());
    Tensor attn = b_.alloc_act(T, heads * c_.v_head_dim);
    if (absorbed_) {
      // The KV layout and the form must agree, or the op would read the cache as the wrong thing.
      MOELORA_CHECK_MSG(kv.kv_heads == 1 && kv.k_head_dim == c_.kv_lora_rank + rope && kv.v_head_dim == 0,
                        "absorbed MLA with a KV cache of {} heads of {} / {} values", kv.kv_heads, kv.k_head_dim,
                        kv.v_head_dim);
      b_.mla_attention_absorbed(q, latent, k_pe, w.kv_b, tab(LoraTarget::kKVB), kv, heads, nope, c_.v_head_dim,
                                scale, attn);
    } else {
      Tensor kvb = b_.alloc_act(T, heads * (nope + c_.v_head_dim));
      b_.linear(latent, w.kv_b, tab(LoraTarget::kKVB), kvb);
      Tensor k = b_.alloc_act(T, heads * qk);
      Tensor v = b_.alloc_act(T, heads * c_.v_head_dim);
      b_.mla_split_kv(kvb, k_pe, heads, nope, c_.v_head_dim, k, v);
      b_.attention(q, k, v, kv, heads, scale, attn);
    }
    Tensor out = b_.alloc_act(T, c_.hidden_size);
    par_.row_linear(b_, attn, w.o, tab(LoraTarget::kO), out);
    return out;
  }

  // silu(x gate^T) * (x up^T): gate and up are column-parallel, so this needs no collective.
  Tensor gated(const MlpWeights& w, const Tensor& x, LoraTarget gate, LoraTarget up) {
    const int T = static_cast<int>(x.rows()), inter = w.gate.out;
    Tensor g, u;
    if (w.gate_up.defined()) {  // one GEMM; gate and up are column slices of its output
      Tensor gu = b_.alloc_act(T, 2 * inter);
      b_.linear_parts(x, w.gate_up, {{0, inter, tab(gate)}, {inter, inter, tab(up)}}, gu);
      g = gu.slice_cols(0, inter);
      u = gu.slice_cols(inter, inter);
    } else {
      g = b_.alloc_act(T, inter);
      u = b_.alloc_act(T, inter);
      b_.linear(x, w.gate, tab(gate), g);
      b_.linear(x, w.up, tab(up), u);
    }
    b_.silu_mul(g, u, g);
    return g;
  }

  Tensor dense_mlp(const MlpWeights& w, const Tensor& x) {
    Tensor g = gated(w, x, LoraTarget::kGate, LoraTarget::kUp);
    Tensor out = b_.alloc_act(static_cast<int>(x.rows()), c_.hidden_size);
    par_.row_linear(b_, g, w.down, tab(LoraTarget::kDown), out);
    return out;
  }

  Tensor moe(const LayerWeights& lw, const Tensor& x) {
    const int T = static_cast<int>(x.rows()), E = c_.num_experts, k = c_.top_k;
    Tensor logits = b_.alloc(T, E, DType::kF32);
    b_.router_logits(x, lw.router, logits);
    Tensor ids = b_.alloc(T, k, DType::kI32);
    Tensor weights = b_.alloc(T, k, DType::kF32);
    if (c_.router == RouterKind::kSigmoidGroupTopK) {
      b_.topk_sigmoid_grouped(logits, lw.router_bias, k, c_.n_group, c_.topk_group, c_.norm_topk_prob,
                              static_cast<float>(c_.routed_scaling_factor), ids, weights);
    } else {
      b_.topk_softmax(logits, k, c_.norm_topk_prob, ids, weights);
    }
    const MoeBlockInputs in{x,
                            ids,
                            weights,
                            lw.experts,
                            layer_lora_ ? layer_lora_->experts : nullptr,
                            lw.has_shared ? &lw.shared.down : nullptr,
                            tab(LoraTarget::kSharedDown)};
    return par_.moe_sum(b_, in, [&] { return gated(lw.shared, x, LoraTarget::kSharedGate, LoraTarget::kSharedUp); });
  }

  const ModelConfig& c_;
  const ModelWeights& w_;
  const RopeTable& rope_;
  Backend& b_;
  ParallelContext& par_;
  const LoraTables* lora_;
  const LayerLoraTables* layer_lora_ = nullptr;
  const bool absorbed_;
};

}  // namespace

Tensor forward_body(const ForwardModel& m, const StepBatch& step, std::vector<KvLayer>& kv, const LoraTables* lora) {
  return Body(m, lora).run(step, kv);
}

Tensor moe_block(const ForwardModel& m, int layer, const Tensor& x, const LoraTables* lora) {
  MOELORA_CHECK_MSG(layer >= 0 && layer < m.cfg.num_layers, "layer {} of {}", layer, m.cfg.num_layers);
  return Body(m, lora).moe_of_layer(layer, x);
}

Tensor attention_block(const ForwardModel& m, int layer, const Tensor& x, KvLayer& kv, const LoraTables* lora) {
  MOELORA_CHECK_MSG(layer >= 0 && layer < m.cfg.num_layers, "layer {} of {}", layer, m.cfg.num_layers);
  return Body(m, lora).attention_of_layer(layer, x, kv);
}

}  // namespace moelora
