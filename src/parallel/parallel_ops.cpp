#include "parallel/parallel_ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"

namespace moelora {

namespace {

// Slot s's factors in a LoRA table (host pointers: the CPU backend's tables).
struct SlotLora {
  const float* a = nullptr;  // [rank, in]
  const float* b = nullptr;  // [out, rank]
  int rank = 0;
};

SlotLora slot_lora(const LoraModuleTable* lora, int slot) {
  if (lora == nullptr || slot < 0) return {};
  MOELORA_CHECK_MSG(slot < lora->num_slots, "token slot {} outside {} slots", slot, lora->num_slots);
  SlotLora s;
  s.rank = lora->ranks.ptr<int32_t>()[slot];
  if (s.rank == 0) return {};
  s.a = reinterpret_cast<const float*>(lora->a_ptrs.ptr<int64_t>()[slot]);
  s.b = reinterpret_cast<const float*>(lora->b_ptrs.ptr<int64_t>()[slot]);
  return s;
}

}  // namespace

int row_parallel_lora_width(const LoraModuleTable* lora) {
  if (lora == nullptr) return 0;
  return lora->host_rank.empty() ? 0 : *std::max_element(lora->host_rank.begin(), lora->host_rank.end());
}

void row_parallel_partial(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                          const int32_t* slots, Tensor partial) {
  const int width = row_parallel_lora_width(lora);
  MOELORA_CHECK_MSG(partial.rows() == x.rows() && partial.cols() == w.out + width,
                    "row-parallel partial {} for x {} and W [{}, {}] + LoRA width {}", partial.shape_string(),
                    x.shape_string(), w.out, w.in, width);
  b.linear(x, w, nullptr, partial.slice_cols(0, w.out));
  if (width == 0) return;
  MOELORA_CHECK(lora->in == w.in);
  for (int64_t t = 0; t < x.rows(); ++t) {
    float* u = partial.ptr<float>() + t * partial.ld() + w.out;
    std::fill(u, u + width, 0.0f);
    const SlotLora s = slot_lora(lora, slots[t]);
    const float* xr = x.ptr<float>() + t * x.ld();
    for (int k = 0; k < s.rank; ++k) {
      const float* ar = s.a + static_cast<int64_t>(k) * lora->in;
      double acc = 0.0;
      for (int i = 0; i < lora->in; ++i) acc += static_cast<double>(xr[i]) * ar[i];
      u[k] = static_cast<float>(acc);  // travels through the all-reduce as float32
    }
  }
}

void row_parallel_expand(const Tensor& reduced, const LoraModuleTable* lora, const int32_t* slots, Tensor out) {
  const int64_t n = out.cols();
  MOELORA_CHECK(reduced.rows() == out.rows() && reduced.cols() == n + row_parallel_lora_width(lora));
  for (int64_t t = 0; t < out.rows(); ++t) {
    const float* base = reduced.ptr<float>() + t * reduced.ld();
    const float* u = base + n;
    float* y = out.ptr<float>() + t * out.ld();
    const SlotLora s = slot_lora(lora, slots[t]);
    if (s.rank > 0) MOELORA_CHECK(lora->out == n);
    for (int64_t o = 0; o < n; ++o) {
      const float* br = s.b + o * s.rank;
      double acc = 0.0;
      for (int k = 0; k < s.rank; ++k) acc += static_cast<double>(u[k]) * br[k];
      y[o] = static_cast<float>(base[o] + acc);
    }
  }
}

void row_parallel_linear(Backend& b, Communicator& comm, const Tensor& x, const LinearWeight& w,
                         const LoraModuleTable* lora, const int32_t* slots, Tensor out) {
  if (comm.size() == 1) {  // nothing was cut: exactly the single-device projection
    b.linear(x, w, lora, out);
    return;
  }
  Tensor buf = b.alloc(x.rows(), w.out + row_parallel_lora_width(lora), DType::kF32);
  row_parallel_partial(b, x, w, lora, slots, buf);
  comm.all_reduce_sum(buf.ptr<float>(), static_cast<size_t>(buf.numel()));
  row_parallel_expand(buf, lora, slots, out);
}

void vocab_parallel_embed(const Tensor& shard, int vocab_begin, const std::vector<int32_t>& token_ids,
                          Communicator& comm, Tensor out) {
  const int64_t H = shard.dim(1), rows = shard.dim(0);
  MOELORA_CHECK(out.cols() == H && out.rows() == static_cast<int64_t>(token_ids.size()) && out.contiguous());
  for (size_t t = 0; t < token_ids.size(); ++t) {
    float* dst = out.ptr<float>() + static_cast<int64_t>(t) * H;
    const int64_t local = static_cast<int64_t>(token_ids[t]) - vocab_begin;
    if (local >= 0 && local < rows)
      std::memcpy(dst, shard.ptr<float>() + local * H, H * sizeof(float));
    else
      std::fill(dst, dst + H, 0.0f);  // another rank's token: it contributes the row
  }
  if (comm.size() > 1) comm.all_reduce_sum(out.ptr<float>(), static_cast<size_t>(out.numel()));
}

void vocab_parallel_logits(Backend& b, Communicator& comm, const Tensor& x, const LinearWeight& shard, int vocab,
                           Tensor logits) {
  const int64_t R = x.rows(), chunk = shard.out;
  MOELORA_CHECK(logits.rows() == R && logits.cols() == vocab && chunk * comm.size() >= vocab);
  if (comm.size() == 1) {
    b.linear(x, shard, nullptr, logits);
    return;
  }
  Tensor local = b.alloc(R, chunk, DType::kF32);
  b.linear(x, shard, nullptr, local);
  std::vector<float> all(static_cast<size_t>(comm.size()) * R * chunk);
  comm.all_gather(local.ptr<float>(), static_cast<size_t>(R * chunk), all.data());
  for (int p = 0; p < comm.size(); ++p)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < chunk && p * chunk + c < vocab; ++c)
        logits.ptr<float>()[r * logits.ld() + p * chunk + c] = all[(static_cast<size_t>(p) * R + r) * chunk + c];
}

void expert_parallel_moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const int32_t* slots,
                         const ExpertWeights& local, const MoeLoraTable* lora, int expert_begin, int global_experts,
                         Tensor out) {
  MOELORA_CHECK(ids.rows() == x.rows() && weights.rows() == x.rows() && ids.cols() == weights.cols());
  cpu::MoeArgs a;
  a.x = x.ptr<float>();
  a.ldx = x.ld();
  a.T = x.rows();
  a.k = static_cast<int>(ids.cols());
  a.ids = ids.ptr<int32_t>();
  a.weights = weights.ptr<float>();
  a.slot = slots;
  a.w_gate_up = local.gate_up.w.ptr<float>();
  a.w_down = local.down.w.ptr<float>();
  a.E = local.num_experts;
  a.H = local.hidden;
  a.I = local.intermediate;
  a.lora = lora;
  a.out = out.ptr<float>();
  a.ldo = out.ld();
  a.expert_begin = expert_begin;
  a.global_experts = global_experts;
  cpu::moe(a);
}

}  // namespace moelora
