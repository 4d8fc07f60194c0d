// Each rank runs the model's one forward body (model/forward_pass.h) on its own backend, weights,
// KV cache and slot pool, with a ShardedContext for what a rank does differently.
#include "parallel/sharded_forward.h"

#include <cstring>
#include <thread>

#include "backends/cpu/cpu_backend.h"
#include "lora/slot_pool.h"
#include "model/forward_pass.h"
#include "model/fused_projections.h"
#include "parallel/fake_communicator.h"
#include "parallel/sharded_context.h"

namespace moelora {

struct ShardedModel::Groups {
  std::unique_ptr<FakeCommGroup> world;
  std::vector<std::unique_ptr<FakeCommGroup>> tp;  // one per EP index
};

struct ShardedModel::Rank {
  const ModelConfig* cfg = nullptr;  // the whole model's
  const RopeTable* rope = nullptr;
  bool mla_absorbed = false;  // the model's MLA form (Model::mla_absorbed), the same on every rank
  RankLayout layout;
  CpuBackend backend;
  ModelWeights weights;
  std::unique_ptr<LoraSlotPool> pool;
  std::vector<KvLayer> kv;
  std::unique_ptr<Communicator> world;  // all tp x ep ranks: the MoE block's reduce
  std::unique_ptr<Communicator> tp;     // this rank's tensor-parallel group
  std::unique_ptr<ShardedContext> par;  // refers to layout, world and tp

  // The logits of batch.logit_rows on the host: every rank computes all of them.
  Tensor forward(const StepBatch& batch) {
    const StepBatch& step = backend.begin_step(batch);
    par->set_step(step);
    return backend.to_host_f32(
        forward_body({*cfg, weights, *rope, backend, *par, mla_absorbed}, step, kv, &pool->tables()));
  }
};

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
    rank->mla_absorbed = model.mla_absorbed();
    rank->weights = shard_model_weights(cfg, model.weights(), rank->layout);
    fuse_projections(rank->weights, rank->backend, /*keep_parts=*/true);
    rank->pool = std::make_unique<LoraSlotPool>(rank->layout.local, rank->backend, num_slots);
    rank->world = sm->groups_->world->communicator(r);
    rank->tp = sm->groups_->tp[rank->layout.plan.ep_rank()]->communicator(rank->layout.plan.tp_rank());
    rank->par = std::make_unique<ShardedContext>(sm->cfg_, rank->layout, *rank->tp, *rank->world);
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
    // The rank's heads (decompressed), or the whole latent (absorbed: it is not cut by heads).
    const KvShape s = kv_shape(rank->layout.local, rank->mla_absorbed);
    rank->kv.clear();
    for (int l = 0; l < cfg_.num_layers; ++l)
      rank->kv.push_back(rank->backend.alloc_kv_layer(num_pages, page_size, s.kv_heads, s.k_head_dim, s.v_head_dim));
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
