// The per-rank forward pass mirrors Model::forward_body (src/model/model.cpp) op for op; what
// differs is named where it happens: the rank's head and width counts, the row-parallel
// projections, the vocabulary-parallel ends, and the MoE block reduced over every rank.
#include "parallel/sharded_forward.h"

#include <cstring>
#include <thread>

#include "backends/cpu/cpu_backend.h"
#include "lora/slot_pool.h"
#include "parallel/fake_communicator.h"
#include "parallel/parallel_ops.h"

namespace moelora {

struct ShardedModel::Groups {
  std::unique_ptr<FakeCommGroup> world;
  std::vector<std::unique_ptr<FakeCommGroup>> tp;  // one per EP index
};

struct ShardedModel::Rank {
  const ModelConfig* cfg = nullptr;  // the whole model's
  const RopeTable* rope = nullptr;
  RankLayout layout;
  CpuBackend backend;
  ModelWeights weights;
  std::unique_ptr<LoraSlotPool> pool;
  std::vector<KvLayer> kv;
  std::unique_ptr<Communicator> world;  // all tp x ep ranks: the MoE block's reduce
  std::unique_ptr<Communicator> tp;     // this rank's tensor-parallel group

  Tensor forward(const StepBatch& batch);

 private:
  const LoraModuleTable* table(int layer, LoraTarget t) const { return pool->tables()[layer].get(t); }
  Tensor attention_gqa(int layer, const Tensor& x);
  Tensor attention_mla(int layer, const Tensor& x);
  Tensor dense_mlp(int layer, const Tensor& x);
  Tensor moe(int layer, const Tensor& x);
  const int32_t* slots_ = nullptr;
};

Tensor ShardedModel::Rank::forward(const StepBatch& batch) {
  Backend& b = backend;
  const StepBatch& step = b.begin_step(batch);
  slots_ = step.token_slot.data();
  const ModelConfig& c = *cfg;
  const int T = step.num_tokens();
  for (int32_t id : step.token_ids) MOELORA_CHECK_MSG(id >= 0 && id < c.vocab_size, "token id {} outside the vocabulary", id);
  Tensor h = b.alloc_act(T, c.hidden_size);
  vocab_parallel_embed(weights.embed, layout.vocab_begin, step.token_ids, *tp, h);
  Tensor x = b.alloc_act(T, c.hidden_size);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = weights.layers[l];
    const size_t mark = b.scratch_mark();
    b.rmsnorm(h, lw.input_norm, eps, x);
    Tensor a = c.is_mla() ? attention_mla(l, x) : attention_gqa(l, x);
    b.add(a, h);
    b.rmsnorm(h, lw.post_attention_norm, eps, x);
    Tensor m = lw.is_moe ? moe(l, x) : dense_mlp(l, x);
    b.add(m, h);
    b.scratch_release(mark);
  }
  const int R = static_cast<int>(step.logit_rows.size());
  Tensor rows = b.alloc_act(R, c.hidden_size);
  b.gather_logit_rows(h, rows);
  b.rmsnorm(rows, weights.final_norm, eps, rows);
  Tensor logits = b.alloc(R, c.vocab_size, DType::kF32);
  vocab_parallel_logits(b, *tp, rows, weights.lm_head, c.vocab_size, logits);
  return b.to_host_f32(logits);
}

// Heads are the rank's (layout.local): q/k/v hold its query and KV heads, o_proj is row-parallel.
Tensor ShardedModel::Rank::attention_gqa(int layer, const Tensor& x) {
  Backend& b = backend;
  const AttentionWeights& w = weights.layers[layer].attn;
  const ModelConfig& loc = layout.local;
  const int T = static_cast<int>(x.rows()), d = cfg->head_dim;
  Tensor q = b.alloc_act(T, loc.num_heads * d);
  Tensor k = b.alloc_act(T, loc.num_kv_heads * d);
  Tensor v = b.alloc_act(T, loc.num_kv_heads * d);
  b.linear(x, w.q, table(layer, LoraTarget::kQ), q);
  b.linear(x, w.k, table(layer, LoraTarget::kK), k);
  b.linear(x, w.v, table(layer, LoraTarget::kV), v);
  if (w.q_norm.defined()) {
    const float eps = static_cast<float>(cfg->rms_norm_eps);
    b.rmsnorm(q, w.q_norm, eps, q);
    b.rmsnorm(k, w.k_norm, eps, k);
  }
  b.rope(q, loc.num_heads, d, 0, *rope);
  b.rope(k, loc.num_kv_heads, d, 0, *rope);
  Tensor attn = b.alloc_act(T, loc.num_heads * d);
  b.attention(q, k, v, kv[layer], loc.num_heads, static_cast<float>(cfg->attention_scale()), attn);
  Tensor out = b.alloc_act(T, cfg->hidden_size);
  row_parallel_linear(b, *tp, attn, w.o, table(layer, LoraTarget::kO), slots_, out);
  return out;
}

// MLA: q_a / kv_a and their norms are replicated; q_b / kv_b hold the rank's heads.
Tensor ShardedModel::Rank::attention_mla(int layer, const Tensor& x) {
  Backend& b = backend;
  const AttentionWeights& w = weights.layers[layer].attn;
  const ModelConfig& c = *cfg;
  const int heads = layout.local.num_heads;
  const int T = static_cast<int>(x.rows());
  const int nope = c.qk_nope_head_dim, rope_dim = c.qk_rope_head_dim, qk = nope + rope_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Tensor q = b.alloc_act(T, heads * qk);
  if (c.q_lora_rank > 0) {
    Tensor qa = b.alloc_act(T, c.q_lora_rank);
    b.linear(x, w.q_a, table(layer, LoraTarget::kQA), qa);
    b.rmsnorm(qa, w.q_a_norm, eps, qa);
    b.linear(qa, w.q_b, table(layer, LoraTarget::kQB), q);
  } else {
    b.linear(x, w.q, table(layer, LoraTarget::kQ), q);
  }
  Tensor ckv = b.alloc_act(T, c.kv_lora_rank + rope_dim);
  b.linear(x, w.kv_a, table(layer, LoraTarget::kKVA), ckv);
  Tensor latent = b.alloc_act(T, c.kv_lora_rank);
  b.rmsnorm(ckv.slice_cols(0, c.kv_lora_rank), w.kv_a_norm, eps, latent);
  Tensor k_pe = ckv.slice_cols(c.kv_lora_rank, rope_dim);
  b.rope(k_pe, 1, rope_dim, 0, *rope);
  b.rope(q, heads, qk, nope, *rope);
  Tensor kvb = b.alloc_act(T, heads * (nope + c.v_head_dim));
  b.linear(latent, w.kv_b, table(layer, LoraTarget::kKVB), kvb);
  Tensor k = b.alloc_act(T, heads * qk);
  Tensor v = b.alloc_act(T, heads * c.v_head_dim);
  b.mla_split_kv(kvb, k_pe, heads, nope, c.v_head_dim, k, v);
  Tensor attn = b.alloc_act(T, heads * c.v_head_dim);
  b.attention(q, k, v, kv[layer], heads, static_cast<float>(c.attention_scale()), attn);
  Tensor out = b.alloc_act(T, c.hidden_size);
  row_parallel_linear(b, *tp, attn, w.o, table(layer, LoraTarget::kO), slots_, out);
  return out;
}

// Dense MLP: gate/up column-parallel, down row-parallel over the TP group.
Tensor ShardedModel::Rank::dense_mlp(int layer, const Tensor& x) {
  Backend& b = backend;
  const MlpWeights& w = weights.layers[layer].mlp;
  const int T = static_cast<int>(x.rows());
  Tensor g = b.alloc_act(T, w.gate.out), u = b.alloc_act(T, w.up.out);
  b.linear(x, w.gate, table(layer, LoraTarget::kGate), g);
  b.linear(x, w.up, table(layer, LoraTarget::kUp), u);
  b.silu_mul(g, u, g);
  Tensor out = b.alloc_act(T, cfg->hidden_size);
  row_parallel_linear(b, *tp, g, w.down, table(layer, LoraTarget::kDown), slots_, out);
  return out;
}

// One reduce over all ranks for the whole block. Buffer columns [0, H): this rank's routed-expert
// partial, plus (EP group 0 only, so that it is counted once) the shared experts' down partial;
// columns [H, H + r): the shared down LoRA's shrink partial, expanded once after the reduce.
Tensor ShardedModel::Rank::moe(int layer, const Tensor& x) {
  Backend& b = backend;
  const ModelConfig& c = *cfg;
  const LayerWeights& lw = weights.layers[layer];
  const int T = static_cast<int>(x.rows()), E = c.num_experts, k = c.top_k, H = c.hidden_size;
  // Routing is replicated: every rank sees the same x and so picks the same experts.
  Tensor logits = b.alloc(T, E, DType::kF32);
  b.router_logits(x, lw.router, logits);
  Tensor ids = b.alloc(T, k, DType::kI32);
  Tensor weights_tk = b.alloc(T, k, DType::kF32);
  if (c.router == RouterKind::kSigmoidGroupTopK)
    b.topk_sigmoid_grouped(logits, lw.router_bias, k, c.n_group, c.topk_group, c.norm_topk_prob,
                           static_cast<float>(c.routed_scaling_factor), ids, weights_tk);
  else
    b.topk_softmax(logits, k, c.norm_topk_prob, ids, weights_tk);

  const bool shared_split = lw.has_shared && layout.plan.tp > 1;
  const LoraModuleTable* shared_down = table(layer, LoraTarget::kSharedDown);
  const int lora_width = shared_split ? row_parallel_lora_width(shared_down) : 0;
  Tensor buf = b.alloc(T, H + lora_width, DType::kF32);
  Tensor routed = buf.slice_cols(0, H);
  expert_parallel_moe(x, ids, weights_tk, slots_, lw.experts, pool->tables()[layer].experts, layout.expert_begin, E,
                      routed);
  if (lw.has_shared && layout.plan.ep_rank() == 0) {
    const MlpWeights& w = lw.shared;
    Tensor g = b.alloc_act(T, w.gate.out), u = b.alloc_act(T, w.up.out);
    b.linear(x, w.gate, table(layer, LoraTarget::kSharedGate), g);
    b.linear(x, w.up, table(layer, LoraTarget::kSharedUp), u);
    b.silu_mul(g, u, g);
    Tensor part = b.alloc(T, H + lora_width, DType::kF32);
    if (shared_split)
      row_parallel_partial(b, g, w.down, shared_down, slots_, part);
    else
      b.linear(g, w.down, shared_down, part);  // nothing cut: the whole projection, LoRA included
    b.add(part.slice_cols(0, H), routed);
    for (int64_t t = 0; t < T; ++t)
      for (int i = 0; i < lora_width; ++i) buf.ptr<float>()[t * buf.ld() + H + i] = part.ptr<float>()[t * part.ld() + H + i];
  }
  if (world->size() > 1) world->all_reduce_sum(buf.ptr<float>(), static_cast<size_t>(buf.numel()));
  Tensor out = b.alloc_act(T, H);
  if (shared_split)
    row_parallel_expand(buf, shared_down, slots_, out);
  else
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.ptr<float>() + t * out.ld(), routed.ptr<float>() + t * routed.ld(), H * sizeof(float));
  return out;
}

ShardedModel::ShardedModel(const ModelConfig& cfg, int tp, int ep)
    : cfg_(cfg), tp_(tp), ep_(ep), rope_(make_rope_table(cfg)) {}

ShardedModel::~ShardedModel() = default;

Result<std::unique_ptr<ShardedModel>> ShardedModel::create(const Model& model, int tp, int ep, int num_slots) {
  if (model.backend().name() != "cpu")
    return unsupported("the sharded forward runs on the float32 CPU backend, not '{}'", model.backend().name());
  const ModelConfig& cfg = model.config();
  MOELORA_RETURN_IF_ERROR(validate_plan(cfg, tp, ep));
  std::unique_ptr<ShardedModel> sm(new ShardedModel(cfg, tp, ep));
  sm->groups_ = std::make_unique<Groups>();
  sm->groups_->world = std::make_unique<FakeCommGroup>(tp * ep);
  for (int e = 0; e < ep; ++e) sm->groups_->tp.push_back(std::make_unique<FakeCommGroup>(tp));
  for (int r = 0; r < tp * ep; ++r) {
    auto rank = std::make_unique<Rank>();
    MOELORA_ASSIGN_OR_RETURN(rank->layout, make_rank_layout(cfg, ParallelPlan{tp, ep, r}));
    rank->cfg = &sm->cfg_;
    rank->rope = &sm->rope_;
    rank->weights = shard_model_weights(cfg, model.weights(), rank->layout);
    rank->pool = std::make_unique<LoraSlotPool>(rank->layout.local, rank->backend, num_slots);
    rank->world = sm->groups_->world->communicator(r);
    rank->tp = sm->groups_->tp[rank->layout.plan.ep_rank()]->communicator(rank->layout.plan.tp_rank());
    sm->ranks_.push_back(std::move(rank));
  }
  return sm;
}

const RankLayout& ShardedModel::layout(int rank) const {
  MOELORA_CHECK(rank >= 0 && rank < world());
  return ranks_[rank]->layout;
}

Result<int> ShardedModel::acquire(const std::shared_ptr<const LoraAdapter>& adapter) {
  auto it = shares_.find(adapter.get());
  if (it == shares_.end()) {
    std::vector<std::shared_ptr<const LoraAdapter>> shares;
    for (const auto& rank : ranks_) shares.push_back(shard_adapter(cfg_, *adapter, rank->layout));
    it = shares_.emplace(adapter.get(), std::make_pair(adapter, std::move(shares))).first;
  }
  int slot = -1;
  for (int r = 0; r < world(); ++r) {
    MOELORA_ASSIGN_OR_RETURN(int s, ranks_[r]->pool->acquire(it->second.second[r]));
    MOELORA_CHECK_MSG(r == 0 || s == slot, "rank {} placed adapter '{}' in slot {}, rank 0 in slot {}", r,
                      adapter->name, s, slot);
    slot = s;
  }
  return slot;
}

void ShardedModel::release(int slot) {
  for (auto& rank : ranks_) rank->pool->release(slot);
}

void ShardedModel::alloc_kv_cache(int num_pages, int page_size) {
  for (auto& rank : ranks_) {
    const ModelConfig& loc = rank->layout.local;
    rank->kv.clear();
    for (int l = 0; l < cfg_.num_layers; ++l)
      rank->kv.push_back(rank->backend.alloc_kv_layer(num_pages, page_size, loc.attn_kv_heads(), loc.attn_k_head_dim(),
                                                      loc.attn_v_head_dim()));
  }
}

Tensor ShardedModel::forward(const StepBatch& batch) {
  MOELORA_CHECK_MSG(!ranks_[0]->kv.empty(), "alloc_kv_cache before forward");
  std::vector<Tensor> logits(ranks_.size());
  if (ranks_.size() == 1) {
    logits[0] = ranks_[0]->forward(batch);
  } else {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks_.size(); ++r)
      threads.emplace_back([&, r] { logits[r] = ranks_[r]->forward(batch); });
    for (std::thread& t : threads) t.join();
  }
  // Replicated state must stay replicated: ranks that disagreed would route differently.
  for (size_t r = 1; r < logits.size(); ++r)
    MOELORA_CHECK_MSG(std::memcmp(logits[r].data(), logits[0].data(), logits[0].nbytes()) == 0,
                      "rank {} computed other logits than rank 0", r);
  return logits[0];
}

}  // namespace moelora
