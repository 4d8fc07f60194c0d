#include "parallel/sharded_context.h"

#include <cstring>

#include "core/check.h"
#include "parallel/parallel_ops.h"

namespace moelora {

void ShardedContext::embed(Backend& b, const StepBatch& step, const Tensor& table, Tensor out) {
  // The masked lookup turns an id no rank holds into a zero row instead of failing: check here,
  // as the single-device embedding op does.
  for (int32_t id : step.token_ids)
    MOELORA_CHECK_MSG(id >= 0 && id < cfg_.vocab_size, "token id {} outside the vocabulary", id);
  vocab_parallel_embed(table, layout_.vocab_begin, step.token_ids, tp_, out);
}

void ShardedContext::row_linear(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                                Tensor out) {
  row_parallel_linear(b, tp_, x, w, lora, slots_, out);
}

// One reduce over all ranks for the whole block. Buffer columns [0, H): this rank's routed-expert
// partial, plus (EP group 0 only, so that it is counted once) the shared experts' down partial;
// columns [H, H + r): the shared down LoRA's shrink partial, expanded once after the reduce.
Tensor ShardedContext::moe_sum(Backend& b, const MoeBlockInputs& in, LazyTensor shared_act) {
  const int64_t T = in.x.rows(), H = cfg_.hidden_size;
  const bool shared_split = in.shared_down != nullptr && layout_.plan.tp > 1;
  const int lora_width = shared_split ? row_parallel_lora_width(in.shared_down_lora) : 0;
  Tensor buf = b.alloc(T, H + lora_width, DType::kF32);
  Tensor routed = buf.slice_cols(0, H);
  expert_parallel_moe(in.x, in.ids, in.weights, slots_, in.experts, in.expert_lora, layout_.expert_begin,
                      cfg_.num_experts, routed);
  if (in.shared_down != nullptr && layout_.plan.ep_rank() == 0) {
    const Tensor g = shared_act();
    Tensor part = b.alloc(T, H + lora_width, DType::kF32);
    if (shared_split)
      row_parallel_partial(b, g, *in.shared_down, in.shared_down_lora, slots_, part);
    else
      b.linear(g, *in.shared_down, in.shared_down_lora, part);  // nothing cut: the whole projection, LoRA included
    b.add(part.slice_cols(0, H), routed);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(buf.ptr<float>() + t * buf.ld() + H, part.ptr<float>() + t * part.ld() + H,
                  static_cast<size_t>(lora_width) * sizeof(float));
  }
  if (world_.size() > 1) world_.all_reduce_sum(buf.ptr<float>(), static_cast<size_t>(buf.numel()));
  Tensor out = b.alloc_act(T, H);
  if (shared_split)
    row_parallel_expand(buf, in.shared_down_lora, slots_, out);
  else
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.ptr<float>() + t * out.ld(), routed.ptr<float>() + t * routed.ld(), H * sizeof(float));
  return out;
}

void ShardedContext::logits(Backend& b, const Tensor& x, const LinearWeight& lm_head, Tensor out) {
  vocab_parallel_logits(b, tp_, x, lm_head, cfg_.vocab_size, out);
}

}  // namespace moelora
