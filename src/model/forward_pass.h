// The forward pass of one step, written once: every architecture (GQA or MLA attention, dense or
// MoE MLP, shared experts) and every parallel layout. What a rank of a tensor/expert-parallel
// split does differently is behind ParallelContext (parallel_context.h); with SingleDeviceContext
// this is the single-device model (Model::forward_logits).
#pragma once

#include <vector>

#include "model/model_config.h"
#include "model/model_weights.h"
#include "model/parallel_context.h"
#include "ops/backend.h"

namespace moelora {

struct ForwardModel {
  const ModelConfig& cfg;       // the whole model's config (shapes that are cut come from `par`)
  const ModelWeights& weights;  // what this device or rank holds
  const RopeTable& rope;
  Backend& backend;
  ParallelContext& par;
  // MLA attention in the absorbed form (Backend::mla_attention_absorbed; `kv` then holds the
  // latent, model.h's kv_shape) instead of the decompressed one. Chosen once per model
  // (Model::mla_absorbed); false for models without MLA.
  bool mla_absorbed;
};

// Runs `step` (as returned by the backend's begin_step) and returns the float32 logits of
// step.logit_rows, [rows, vocab], on the backend. kv: one layer per decoder layer, this rank's
// heads. `lora` may be null (no adapters).
Tensor forward_body(const ForwardModel& m, const StepBatch& step, std::vector<KvLayer>& kv, const LoraTables* lora);

// The MLP of MoE layer `layer` as forward_body runs it, for its normed input x [T, hidden]: router
// logits, top-k (softmax, or DeepSeek's grouped sigmoid with its bias), the routed experts and the
// shared ones, with their LoRA from `lora` (may be null). Returns the block's output [T, hidden]
// (before the residual add). The MoE block workbench (dev/moe_block.cu) times it alone.
Tensor moe_block(const ForwardModel& m, int layer, const Tensor& x, const LoraTables* lora);

// The attention of layer `layer` as forward_body runs it, for its normed input x [T, hidden] of
// the step the backend is running: GQA (q|k|v, head norms, RoPE, the cache write, attention over
// `kv`, o_proj) or MLA in the model's form, with the LoRA of `lora` (may be null). Returns o_proj's
// output [T, hidden] (before the residual add). The attention block workbench
// (dev/attention_block.cu) times it alone.
Tensor attention_block(const ForwardModel& m, int layer, const Tensor& x, KvLayer& kv, const LoraTables* lora);

}  // namespace moelora
