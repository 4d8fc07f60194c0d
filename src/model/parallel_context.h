// The points where a forward pass split over ranks differs from the single-device one, as an
// interface. The forward body (forward_pass.h) is written once and calls these hooks wherever a
// rank's share, a collective or a vocabulary / expert range changes what is computed; everything
// else (norms, column-parallel projections, RoPE, attention, routing) is the same program on one
// device and on every rank. SingleDeviceContext fills the hooks with the backend's ops, which is
// exactly the unsharded model; src/parallel fills them for a tensor/expert-parallel rank. model
// only defines the interface so that dependencies keep pointing one way (parallel → model).
#pragma once

#include "model/model_config.h"
#include "ops/backend.h"

namespace moelora {

// The MoE block after routing, which is replicated (same x and router on every rank, so the same
// experts are picked everywhere): what the context sums into the block's output.
struct MoeBlockInputs {
  const Tensor& x;                        // [T, H] the block's normalised input
  const Tensor& ids;                      // [T, k] global expert ids
  const Tensor& weights;                  // [T, k] routing weights
  const ExpertWeights& experts;           // the routed experts this rank holds
  const MoeLoraTable* expert_lora;        // their LoRA (null: no adapter targets them)
  const LinearWeight* shared_down;        // the shared experts' down_proj; null: the layer has none
  const LoraModuleTable* shared_down_lora;
};

// A tensor the body computes only if a hook asks for it: a non-owning reference to a callable
// (it must outlive the call it is passed to). Unlike std::function it never allocates, so the body
// adds no host allocation of its own to a step.
class LazyTensor {
 public:
  template <class F>
  LazyTensor(const F& f) : fn_(&f), call_([](const void* fn) { return (*static_cast<const F*>(fn))(); }) {}
  Tensor operator()() const { return call_(fn_); }

 private:
  const void* fn_;
  Tensor (*call_)(const void*);
};

class ParallelContext {
 public:
  // Attention heads this rank computes: query heads, and GQA KV heads (MLA has none of its own).
  ParallelContext(int num_heads, int num_kv_heads) : num_heads_(num_heads), num_kv_heads_(num_kv_heads) {}
  virtual ~ParallelContext() = default;
  int num_heads() const { return num_heads_; }
  int num_kv_heads() const { return num_kv_heads_; }

  // out [T, H]: row token_ids[t] of the embedding `table` (this rank's rows of it).
  virtual void embed(Backend& b, const StepBatch& step, const Tensor& table, Tensor out) = 0;

  // A projection whose input dimension may be cut over ranks (o_proj, a dense down_proj):
  // out = x W^T + the LoRA delta of each token's slot, summed over the ranks that share it.
  virtual void row_linear(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                          Tensor out) = 0;

  // The MoE block's output [T, H]: the routed experts plus, where the layer has them, the shared
  // experts' down_proj applied to shared_act() (their gated activation, which the body computes
  // and the context asks for only on ranks that contribute it). The result is the whole block's,
  // the same on every rank.
  virtual Tensor moe_sum(Backend& b, const MoeBlockInputs& in, LazyTensor shared_act) = 0;

  // out [R, vocab] (float32) = x lm_head^T over the whole vocabulary (`lm_head`: this rank's rows).
  virtual void logits(Backend& b, const Tensor& x, const LinearWeight& lm_head, Tensor out) = 0;

 private:
  int num_heads_, num_kv_heads_;
};

// One device holds the whole model: every hook is the plain backend op.
class SingleDeviceContext final : public ParallelContext {
 public:
  explicit SingleDeviceContext(const ModelConfig& cfg) : ParallelContext(cfg.num_heads, cfg.num_kv_heads) {}
  void embed(Backend& b, const StepBatch& step, const Tensor& table, Tensor out) override;
  void row_linear(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                  Tensor out) override;
  Tensor moe_sum(Backend& b, const MoeBlockInputs& in, LazyTensor shared_act) override;
  void logits(Backend& b, const Tensor& x, const LinearWeight& lm_head, Tensor out) override;
};

}  // namespace moelora
