#include "model/parallel_context.h"

namespace moelora {

void SingleDeviceContext::embed(Backend& b, const StepBatch& step, const Tensor& table, Tensor out) {
  (void)step;  // the backend reads the step's token ids itself (begin_step)
  b.embed(table, out);
}

void SingleDeviceContext::row_linear(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                                     Tensor out) {
  b.linear(x, w, lora, out);
}

Tensor SingleDeviceContext::moe_sum(Backend& b, const MoeBlockInputs& in, LazyTensor shared_act) {
  const int64_t T = in.x.rows(), H = in.x.cols();
  Tensor out = b.alloc_act(T, H);
  if (in.shared_down == nullptr) {
    b.moe(in.x, in.ids, in.weights, in.experts, in.expert_lora, out);
    return out;
  }
  // The shared experts read only x, the routed ones x and the routing: the backend may overlap them.
  Tensor shared = b.alloc_act(T, H);
  b.concurrently([&] { b.linear(shared_act(), *in.shared_down, in.shared_down_lora, shared); },
                 [&] { b.moe(in.x, in.ids, in.weights, in.experts, in.expert_lora, out); });
  b.add(shared, out);
  return out;
}

void SingleDeviceContext::logits(Backend& b, const Tensor& x, const LinearWeight& lm_head, Tensor out) {
  b.linear(x, lm_head, nullptr, out);
}

}  // namespace moelora
