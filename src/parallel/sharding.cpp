#include "parallel/sharding.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace moelora {

namespace {

bool any_layer(const ModelConfig& cfg, bool moe) {
  return std::any_of(cfg.layer_is_moe.begin(), cfg.layer_is_moe.end(), [moe](bool m) { return m == moe; });
}

int q_head_width(const ModelConfig& c) { return c.is_mla() ? c.qk_nope_head_dim + c.qk_rope_head_dim : c.head_dim; }

// Rows [begin, begin + count) of a 2-D float32 tensor as a new contiguous tensor; rows past the
// end of `t` are zero (vocabulary padding).
Tensor copy_rows(const Tensor& t, int64_t begin, int64_t count) {
  MOELORA_CHECK(t.dtype() == DType::kF32 && t.ndim() == 2 && t.contiguous());
  Tensor out = Tensor::empty_host(DType::kF32, {count, t.dim(1)});
  const int64_t n = std::clamp<int64_t>(t.dim(0) - begin, 0, count);
  if (n > 0) std::memcpy(out.data(), t.ptr<float>() + begin * t.dim(1), n * t.dim(1) * sizeof(float));
  return out;
}

// Columns [begin, begin + count) of a 2-D float32 tensor as a new contiguous tensor.
Tensor copy_cols(const Tensor& t, int64_t begin, int64_t count) {
  MOELORA_CHECK(t.dtype() == DType::kF32 && t.ndim() == 2 && t.contiguous() && begin + count <= t.dim(1));
  Tensor out = Tensor::empty_host(DType::kF32, {t.dim(0), count});
  for (int64_t r = 0; r < t.dim(0); ++r)
    std::memcpy(out.ptr<float>() + r * count, t.ptr<float>() + r * t.dim(1) + begin, count * sizeof(float));
  return out;
}

LinearWeight cut_linear(const LinearWeight& w, const ProjectionCut& cut) {
  if (!w.defined() || cut.kind == ProjectionCut::Kind::kReplicated) return w;
  MOELORA_CHECK_MSG(w.w.dtype() == DType::kF32 && !w.scale_inv.defined(),
                    "sharding expects the CPU backend's float32 weights");
  LinearWeight out = w;
  if (cut.kind == ProjectionCut::Kind::kColumn) {
    out.w = copy_rows(w.w, cut.begin, cut.count);
    out.out = static_cast<int>(cut.count);
  } else {
    out.w = copy_cols(w.w, cut.begin, cut.count);
    out.in = static_cast<int>(cut.count);
  }
  out.split_rows = 0;
  return out;
}

LoraFactor cut_factor(const LoraFactor& f, const ProjectionCut& cut) {
  if (f.rank == 0 || cut.kind == ProjectionCut::Kind::kReplicated) return f;
  LoraFactor out = f;
  if (cut.kind == ProjectionCut::Kind::kColumn)
    out.b = copy_rows(f.b, cut.begin, cut.count);  // B [out, r]: the rank's output rows
  else
    out.a = copy_cols(f.a, cut.begin, cut.count);  // A [r, in]: the rank's input columns
  return out;
}

// The projection of a layer that a dense LoRA target names (nullptr if the layer has none).
LinearWeight* projection_of(LayerWeights& lw, LoraTarget t) {
  switch (t) {
    case LoraTarget::kQ: return &lw.attn.q;
    case LoraTarget::kK: return &lw.attn.k;
    case LoraTarget::kV: return &lw.attn.v;
    case LoraTarget::kO: return &lw.attn.o;
    case LoraTarget::kQA: return &lw.attn.q_a;
    case LoraTarget::kQB: return &lw.attn.q_b;
    case LoraTarget::kKVA: return &lw.attn.kv_a;
    case LoraTarget::kKVB: return &lw.attn.kv_b;
    case LoraTarget::kGate: return lw.is_moe ? nullptr : &lw.mlp.gate;
    case LoraTarget::kUp: return lw.is_moe ? nullptr : &lw.mlp.up;
    case LoraTarget::kDown: return lw.is_moe ? nullptr : &lw.mlp.down;
    case LoraTarget::kSharedGate: return lw.has_shared ? &lw.shared.gate : nullptr;
    case LoraTarget::kSharedUp: return lw.has_shared ? &lw.shared.up : nullptr;
    case LoraTarget::kSharedDown: return lw.has_shared ? &lw.shared.down : nullptr;
    case LoraTarget::kCount: break;
  }
  return nullptr;
}

// Routed experts: the rank's experts, each with its intermediate slice (gate rows, up rows and
// down columns [ib, ib + il) of that expert).
ExpertWeights shard_experts(const ExpertWeights& full, const RankLayout& l) {
  const int H = full.hidden, I = full.intermediate;
  const int eb = l.expert_begin, ne = l.local.num_experts, ib = l.moe_inter_begin, il = l.local.moe_intermediate_size;
  MOELORA_CHECK(full.gate_up.w.dtype() == DType::kF32 && !full.gate_up.scale_inv.defined());
  ExpertWeights out;
  out.num_experts = ne;
  out.hidden = H;
  out.intermediate = il;
  Tensor gu = Tensor::empty_host(DType::kF32, {static_cast<int64_t>(ne) * 2 * il, H});
  Tensor dn = Tensor::empty_host(DType::kF32, {static_cast<int64_t>(ne) * H, il});
  const float* src_gu = full.gate_up.w.ptr<float>();
  const float* src_dn = full.down.w.ptr<float>();
  for (int le = 0; le < ne; ++le) {
    const int64_t e = eb + le;
    for (int half = 0; half < 2; ++half)  // gate rows, then up rows
      std::memcpy(gu.ptr<float>() + (static_cast<int64_t>(le) * 2 * il + half * il) * H,
                  src_gu + (e * 2 * I + half * I + ib) * H, static_cast<size_t>(il) * H * sizeof(float));
    for (int h = 0; h < H; ++h)
      std::memcpy(dn.ptr<float>() + (static_cast<int64_t>(le) * H + h) * il, src_dn + (e * H + h) * I + ib,
                  static_cast<size_t>(il) * sizeof(float));
  }
  out.gate_up = full.gate_up;
  out.gate_up.w = gu;
  out.gate_up.out = 2 * il * ne;
  out.gate_up.split_rows = 0;
  out.down = full.down;
  out.down.w = dn;
  out.down.out = H * ne;
  out.down.in = il;
  return out;
}

// Per-expert LoRA factors [E, rows, cols] of the rank's experts; a leading dimension of 1 (one
// factor shared by all experts) is kept as it is.
Tensor local_experts(const Tensor& t, int eb, int ne) {
  if (t.dim(0) == 1) return t;
  const int64_t rows = t.dim(1), cols = t.dim(2);
  Tensor flat = copy_rows(t.reshape({t.dim(0) * rows, cols}), eb * rows, ne * rows);
  return flat.reshape({ne, rows, cols});
}

ExpertLora shard_expert_lora(const ExpertLora& x, const RankLayout& l, int I) {
  const int eb = l.expert_begin, ne = l.local.num_experts, ib = l.moe_inter_begin, il = l.local.moe_intermediate_size;
  ExpertLora out;
  if (x.gu_rank > 0) {
    const int r = x.gu_rank;
    out.gu_rank = r;
    out.gu_a = local_experts(x.gu_a, eb, ne);  // A [r, H]: the input is not cut
    // B [2I, r]: the gate rows and the up rows of the rank's intermediate slice.
    out.gu_b = Tensor::empty_host(DType::kF32, {ne, 2 * il, r});
    for (int le = 0; le < ne; ++le)
      for (int half = 0; half < 2; ++half)
        std::memcpy(out.gu_b.ptr<float>() + (static_cast<int64_t>(le) * 2 * il + half * il) * r,
                    x.gu_b.ptr<float>() + ((static_cast<int64_t>(eb) + le) * 2 * I + half * I + ib) * r,
                    static_cast<size_t>(il) * r * sizeof(float));
  }
  if (x.d_rank > 0) {
    const int r = x.d_rank;
    out.d_rank = r;
    // A [r, I]: the rank's input columns; B [H, r] whole (the partial expand is reduced with the
    // base partial: sum over ranks of B (A_p a_p) = B (A a)).
    Tensor a = local_experts(x.d_a, eb, ne);
    out.d_a = copy_cols(a.reshape({ne * static_cast<int64_t>(r), I}), ib, il).reshape({ne, r, il});
    out.d_b = local_experts(x.d_b, eb, ne);
  }
  return out;
}

}  // namespace

Status validate_plan(const ModelConfig& cfg, int tp, int ep, bool fp8_block_aligned) {
  if (tp < 1 || ep < 1) return invalid_argument("--tp and --ep must be at least 1 (got {} and {})", tp, ep);
  const bool dense = any_layer(cfg, false), moe = any_layer(cfg, true);
  if (cfg.num_heads % tp != 0)
    return invalid_argument("--tp {} does not divide the model's {} attention heads", tp, cfg.num_heads);
  if (!cfg.is_mla() && cfg.num_kv_heads % tp != 0 && tp % cfg.num_kv_heads != 0)
    return invalid_argument("--tp {} neither divides the model's {} KV heads nor is a multiple of them "
                            "(each KV head must live whole on tp / kv_heads ranks)",
                            tp, cfg.num_kv_heads);
  if (dense && cfg.intermediate_size % tp != 0)
    return invalid_argument("--tp {} does not divide the dense MLP's intermediate size {}", tp, cfg.intermediate_size);
  if (moe && cfg.moe_intermediate_size % tp != 0)
    return invalid_argument("--tp {} does not divide the experts' intermediate size {}", tp, cfg.moe_intermediate_size);
  if (ep > 1 && !moe) return invalid_argument("--ep {}: this model has no routed experts to spread", ep);
  if (moe && ep > cfg.num_experts)
    return invalid_argument("--ep {} is more ranks than the model's {} routed experts", ep, cfg.num_experts);
  if (fp8_block_aligned && cfg.weight_format.is_fp8() && tp > 1) {
    // Every cut dimension of a weight that stays FP8 must hold whole quantisation blocks.
    const int bo = cfg.weight_format.block_out, bi = cfg.weight_format.block_in, hq = cfg.num_heads / tp;
    struct Cut { const char* what; int size; int block; bool applies; };
    const Cut cuts[] = {
        {"query rows per rank", hq * q_head_width(cfg), bo, true},
        {"KV rows per rank", std::max(1, cfg.num_kv_heads / tp) * cfg.head_dim, bo, !cfg.is_mla()},
        {"kv_b rows per rank", hq * (cfg.qk_nope_head_dim + cfg.v_head_dim), bo, cfg.is_mla()},
        {"o_proj input columns per rank", hq * cfg.attn_v_head_dim(), bi, true},
        {"dense MLP intermediate per rank", cfg.intermediate_size / tp, std::max(bo, bi), dense},
        {"expert intermediate per rank", cfg.moe_intermediate_size / tp, std::max(bo, bi), moe},
    };
    for (const Cut& c : cuts)
      if (c.applies && c.size % c.block != 0)
        return invalid_argument("--tp {}: {} is {}, not a multiple of the FP8 block size {} (each block has one scale);"
                                " use a smaller --tp and a larger --ep",
                                tp, c.what, c.size, c.block);
  }
  return {};
}

Result<RankLayout> make_rank_layout(const ModelConfig& cfg, const ParallelPlan& plan) {
  MOELORA_RETURN_IF_ERROR(validate_plan(cfg, plan.tp, plan.ep));
  if (plan.rank < 0 || plan.rank >= plan.world())
    return invalid_argument("rank {} outside 0..{}", plan.rank, plan.world() - 1);
  const int tp = plan.tp, tr = plan.tp_rank(), er = plan.ep_rank();
  RankLayout l;
  l.plan = plan;
  l.local = cfg;
  ModelConfig& loc = l.local;
  loc.num_heads = cfg.num_heads / tp;
  l.q_head_begin = tr * loc.num_heads;
  if (!cfg.is_mla()) {
    if (cfg.num_kv_heads % tp == 0) {
      loc.num_kv_heads = cfg.num_kv_heads / tp;
      l.kv_head_begin = tr * loc.num_kv_heads;
    } else {  // tp is a multiple of kv_heads: tp / kv_heads consecutive ranks share one KV head
      loc.num_kv_heads = 1;
      l.kv_head_begin = tr / (tp / cfg.num_kv_heads);
    }
  }
  if (any_layer(cfg, false)) {
    loc.intermediate_size = cfg.intermediate_size / tp;
    l.dense_inter_begin = tr * loc.intermediate_size;
  }
  if (any_layer(cfg, true)) {
    loc.moe_intermediate_size = cfg.moe_intermediate_size / tp;
    l.moe_inter_begin = tr * loc.moe_intermediate_size;
    l.shared_begin = tr * loc.moe_intermediate_size * cfg.n_shared_experts;
    const int E = cfg.num_experts, ep = plan.ep;
    l.expert_begin = er * E / ep;
    loc.num_experts = (er + 1) * E / ep - l.expert_begin;
  }
  l.vocab_chunk = (cfg.vocab_size + tp - 1) / tp;
  l.vocab_begin = tr * l.vocab_chunk;
  return l;
}

ProjectionCut projection_cut(const ModelConfig& cfg, const RankLayout& l, LoraTarget t) {
  using K = ProjectionCut::Kind;
  if (l.plan.tp == 1) return {};  // one rank holds everything: nothing to cut or reduce
  const ModelConfig& loc = l.local;
  const int hq = loc.num_heads, hb = l.q_head_begin;
  const int shared_width = loc.moe_intermediate_size * cfg.n_shared_experts;
  switch (t) {
    case LoraTarget::kQ: return {K::kColumn, int64_t{hb} * q_head_width(cfg), int64_t{hq} * q_head_width(cfg)};
    case LoraTarget::kK:
    case LoraTarget::kV:
      return {K::kColumn, int64_t{l.kv_head_begin} * cfg.head_dim, int64_t{loc.num_kv_heads} * cfg.head_dim};
    case LoraTarget::kO: return {K::kRow, int64_t{hb} * cfg.attn_v_head_dim(), int64_t{hq} * cfg.attn_v_head_dim()};
    case LoraTarget::kQA:
    case LoraTarget::kKVA: return {};  // MLA's low-rank down projections are shared by all heads
    case LoraTarget::kQB: return {K::kColumn, int64_t{hb} * q_head_width(cfg), int64_t{hq} * q_head_width(cfg)};
    case LoraTarget::kKVB: {
      const int w = cfg.qk_nope_head_dim + cfg.v_head_dim;
      return {K::kColumn, int64_t{hb} * w, int64_t{hq} * w};
    }
    case LoraTarget::kGate:
    case LoraTarget::kUp: return {K::kColumn, l.dense_inter_begin, loc.intermediate_size};
    case LoraTarget::kDown: return {K::kRow, l.dense_inter_begin, loc.intermediate_size};
    case LoraTarget::kSharedGate:
    case LoraTarget::kSharedUp: return {K::kColumn, l.shared_begin, shared_width};
    case LoraTarget::kSharedDown: return {K::kRow, l.shared_begin, shared_width};
    case LoraTarget::kCount: break;
  }
  return {};
}

ModelWeights shard_model_weights(const ModelConfig& cfg, const ModelWeights& full, const RankLayout& l) {
  ModelWeights out;
  // Vocabulary-parallel embedding and lm_head: the rank's rows, zero past the vocabulary.
  out.embed = l.plan.tp == 1 ? full.embed : copy_rows(full.embed, l.vocab_begin, l.vocab_chunk);
  out.lm_head = full.lm_head;
  if (l.plan.tp > 1) {
    out.lm_head.w = copy_rows(full.lm_head.w, l.vocab_begin, l.vocab_chunk);
    out.lm_head.out = l.vocab_chunk;
  }
  out.final_norm = full.final_norm;
  out.layers = full.layers;  // norms, routers and replicated projections stay shared
  for (int layer = 0; layer < cfg.num_layers; ++layer) {
    LayerWeights& lw = out.layers[layer];
    // Fused projections hold every head's rows: each rank fuses its own cut parts again
    // (ShardedModel::create, fuse_projections).
    lw.attn.qkv = LinearWeight();
    lw.attn.q_a_kv_a = LinearWeight();
    lw.mlp.gate_up = LinearWeight();
    lw.shared.gate_up = LinearWeight();
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      if (LinearWeight* w = projection_of(lw, target)) *w = cut_linear(*w, projection_cut(cfg, l, target));
    }
    if (lw.is_moe) lw.experts = shard_experts(full.layers[layer].experts, l);
  }
  return out;
}

std::shared_ptr<const LoraAdapter> shard_adapter(const ModelConfig& cfg, const LoraAdapter& full, const RankLayout& l) {
  auto out = std::make_shared<LoraAdapter>();
  out->name = full.name;
  out->path = full.path;
  out->max_rank = full.max_rank;
  out->notes = full.notes;
  out->dense.resize(full.dense.size());
  out->experts.resize(full.experts.size());
  for (size_t layer = 0; layer < full.dense.size(); ++layer) {
    for (int t = 0; t < kNumLoraTargets; ++t)
      out->dense[layer][t] = cut_factor(full.dense[layer][t], projection_cut(cfg, l, static_cast<LoraTarget>(t)));
    if (full.experts[layer].any())
      out->experts[layer] = shard_expert_lora(full.experts[layer], l, cfg.moe_intermediate_size);
  }
  size_t bytes = 0;
  for (const auto& layer : out->dense)
    for (const LoraFactor& f : layer)
      if (f.rank > 0) bytes += f.a.nbytes() + f.b.nbytes();
  for (const ExpertLora& x : out->experts)
    for (const Tensor* t : {&x.gu_a, &x.gu_b, &x.d_a, &x.d_b})
      if (t->defined()) bytes += t->nbytes();
  out->bytes = bytes;
  return out;
}

}  // namespace moelora
