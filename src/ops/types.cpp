#include "ops/types.h"

namespace moelora {

LoraModuleTable make_lora_table(int num_slots, int in, int out, const TableAlloc& alloc) {
  LoraModuleTable t;
  t.num_slots = num_slots;
  t.in = in;
  t.out = out;
  t.a_ptrs = alloc(DType::kI64, num_slots);
  t.b_ptrs = alloc(DType::kI64, num_slots);
  t.ranks = alloc(DType::kI32, num_slots);
  t.host_rank.assign(num_slots, 0);
  return t;
}

MoeLoraTable make_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate, const TableAlloc& alloc) {
  MoeLoraTable t;
  t.num_slots = num_slots;
  t.num_experts = num_experts;
  t.hidden = hidden;
  t.intermediate = intermediate;
  for (Tensor* p : {&t.gu_a, &t.gu_a_expert_stride, &t.gu_b, &t.gu_b_expert_stride, &t.d_a, &t.d_a_expert_stride,
                    &t.d_b, &t.d_b_expert_stride})
    *p = alloc(DType::kI64, num_slots);
  t.gu_rank = alloc(DType::kI32, num_slots);
  t.d_rank = alloc(DType::kI32, num_slots);
  t.host_gu_rank.assign(num_slots, 0);
  t.host_d_rank.assign(num_slots, 0);
  return t;
}

}  // namespace moelora
