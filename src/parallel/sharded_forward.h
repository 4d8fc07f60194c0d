// A model's forward pass split over tp x ep ranks, executed on the CPU: every rank is a thread
// with its own CpuBackend, its share of the weights and adapters (sharding.h), its own KV cache
// and LoRA slot pool, and FakeCommunicator groups (the world, and its tensor-parallel group); it
// runs the model's one forward body (model/forward_pass.h) with a ShardedContext (sharded_context.h).
// It is the executable statement of the multi-GPU design: the same per-rank program would run as
// one process per GPU with NCCL communicators (docs/multi_gpu.md). Tests compare its logits with
// the single-device Model::forward.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "core/status.h"
#include "lora/adapter.h"
#include "model/model.h"
#include "parallel/sharding.h"

namespace moelora {

class ShardedModel {
 public:
  // Splits `model` (loaded on the float32 CPU backend) over tp x ep ranks with `num_slots` adapter
  // slots per rank. Refuses plans the model's shapes do not allow (validate_plan).
  static Result<std::unique_ptr<ShardedModel>> create(const Model& model, int tp, int ep, int num_slots);
  ~ShardedModel();

  int tp() const { return tp_; }
  int ep() const { return ep_; }
  int world() const { return tp_ * ep_; }
  const ModelConfig& config() const { return cfg_; }
  const RankLayout& layout(int rank) const;

  // Gives every rank its share of `adapter` in a slot. Each rank's slot pool sees the same calls
  // and so makes the same choice (as the processes of a real deployment would); that slot is
  // returned. Tokens name it in StepBatch::token_slot, as with a single-device LoraSlotPool.
  Result<int> acquire(const std::shared_ptr<const LoraAdapter>& adapter);
  void release(int slot);

  // Every rank's KV cache: `num_pages` pages of `page_size` positions (its own heads only; an
  // absorbed-MLA model's latent cache is whole on every rank). The model's MLA form is kept.
  void alloc_kv_cache(int num_pages, int page_size);

  // One step on all ranks (threads); the logits of batch.logit_rows as a host float32 tensor
  // [rows, vocab]. Every rank computes the logits; they must agree bit for bit (checked).
  Tensor forward(const StepBatch& batch);

 private:
  struct Rank;
  ShardedModel(const ModelConfig& cfg, int tp, int ep);

  ModelConfig cfg_;
  int tp_, ep_;
  RopeTable rope_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  struct Groups;
  std::unique_ptr<Groups> groups_;
  // Each adapter's per-rank shares, made once (slot pools find resident adapters by pointer).
  std::map<const LoraAdapter*, std::pair<std::shared_ptr<const LoraAdapter>, std::vector<std::shared_ptr<const LoraAdapter>>>>
      shares_;
};

}  // namespace moelora
