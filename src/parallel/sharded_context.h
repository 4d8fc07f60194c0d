// The ParallelContext of one rank of a tp x ep split (sharding.h says what the rank holds): the
// hooks of the shared forward body (model/forward_pass.h) done with this rank's shares and the
// collectives of parallel_ops.h. Everything the body computes outside these hooks is either
// replicated or column-parallel and needs no communication.
#pragma once

#include <cstdint>

#include "model/parallel_context.h"
#include "parallel/communicator.h"
#include "parallel/sharding.h"

namespace moelora {

class ShardedContext final : public ParallelContext {
 public:
  // cfg: the whole model's; layout: this rank's share. tp: the rank's tensor-parallel group (the
  // row-parallel reduces, the vocabulary ends); world: all tp x ep ranks (the MoE block's reduce).
  // All must outlive the context.
  ShardedContext(const ModelConfig& cfg, const RankLayout& layout, Communicator& tp, Communicator& world)
      : ParallelContext(layout.local.num_heads, layout.local.num_kv_heads),
        cfg_(cfg),
        layout_(layout),
        tp_(tp),
        world_(world) {}

  // The step about to run (the backend's begin_step result): the LoRA work that this context does
  // outside the backend's linear (shrink before the reduce, expand after it) reads its per-token
  // slots. Called before every forward_body.
  void set_step(const StepBatch& step) { slots_ = step.token_slot.data(); }

  void embed(Backend& b, const StepBatch& step, const Tensor& table, Tensor out) override;
  void row_linear(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                  Tensor out) override;
  Tensor moe_sum(Backend& b, const MoeBlockInputs& in, LazyTensor shared_act) override;
  void logits(Backend& b, const Tensor& x, const LinearWeight& lm_head, Tensor out) override;

 private:
  const ModelConfig& cfg_;
  const RankLayout& layout_;
  Communicator& tp_;
  Communicator& world_;
  const int32_t* slots_ = nullptr;
};

}  // namespace moelora
