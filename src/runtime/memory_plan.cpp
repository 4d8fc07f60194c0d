#include "runtime/memory_plan.h"

#include <fmt/format.h>

#include "model/archs.h"

namespace moelora {

namespace {
double gib(size_t b) { return static_cast<double>(b) / (1ull << 30); }
}  // namespace

size_t adapter_slot_bytes(const ModelConfig& c, int rank) {
  const size_t r = static_cast<size_t>(rank), bf16 = 2;
  size_t total = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int t = 0; t < kNumLoraTargets; ++t) {
      auto [in, out] = lora_target_shape(c, l, static_cast<LoraTarget>(t));
      total += r * (static_cast<size_t>(in) + out) * bf16;
    }
    if (l < static_cast<int>(c.layer_is_moe.size()) && c.layer_is_moe[l]) {
      const size_t H = c.hidden_size, I = c.moe_intermediate_size;
      // gate_up: A [r, H], B [2I, r]; down: A [r, I], B [H, r] — per expert.
      total += static_cast<size_t>(c.num_experts) * r * (H + 2 * I + I + H) * bf16;
    }
  }
  return total;
}

size_t kv_page_bytes(const ModelConfig& c, const KvShape& kv, int page_size, size_t act_bytes) {
  return static_cast<size_t>(c.num_layers) * page_size * static_cast<size_t>(kv.values_per_token()) * act_bytes;
}

Result<MemoryPlan> plan_memory(const MemoryInputs& in) {
  if (!(in.utilization > 0.0 && in.utilization <= 1.0))
    return invalid_argument("--gpu-memory-utilization must be in (0, 1], got {}", in.utilization);
  if (in.page_bytes == 0 || in.pages_per_sequence < 1 || in.device_total == 0)
    return invalid_argument("memory plan: page size, sequence length and device size must be positive");
  const size_t in_use = in.device_total - std::min(in.device_free, in.device_total);
  const size_t allowed = static_cast<size_t>(in.utilization * static_cast<double>(in.device_total));
  MemoryPlan p;
  p.budget = allowed > in_use ? allowed - in_use : 0;
  const size_t for_kv = p.budget > in.adapter_reserve ? p.budget - in.adapter_reserve : 0;
  const size_t one_seq = in.page_bytes * static_cast<size_t>(in.pages_per_sequence);
  if (in.kv_pages_override > 0) {
    const size_t want = in.page_bytes * static_cast<size_t>(in.kv_pages_override);
    if (want > for_kv)
      return make_error(ErrorCode::kResourceExhausted,
                        "--kv-cache-pages {} needs {:.2f} GiB but only {:.2f} GiB are left for the KV cache ({:.2f} GiB "
                        "in use, {:.2f} GiB kept for adapters, --gpu-memory-utilization {}): lower --kv-cache-pages "
                        "or raise --gpu-memory-utilization",
                        in.kv_pages_override, gib(want), gib(for_kv), gib(in_use), gib(in.adapter_reserve),
                        in.utilization);
    p.kv_pages = in.kv_pages_override;
  } else {
    if (for_kv < one_seq)
      return make_error(ErrorCode::kResourceExhausted,
                        "the KV cache gets {:.2f} GiB but one sequence of the maximum length needs {:.2f} GiB "
                        "({:.2f} GiB of {:.2f} GiB in use by weights and step scratch, {:.2f} GiB kept for adapter "
                        "slots, --gpu-memory-utilization {}): raise --gpu-memory-utilization, or lower "
                        "--max-model-len, --max-loras-per-batch or --max-lora-rank",
                        gib(for_kv), gib(one_seq), gib(in_use), gib(in.device_total), gib(in.adapter_reserve),
                        in.utilization);
    const size_t pages = for_kv / in.page_bytes;
    p.kv_pages = static_cast<int>(std::min<size_t>(pages, 1u << 30));
  }
  p.kv_bytes = in.page_bytes * static_cast<size_t>(p.kv_pages);
  p.summary = fmt::format("memory: {:.2f} GiB device, {:.2f} GiB in use (weights, step scratch, sampling), "
                          "{:.2f} GiB kept for adapter slots, {:.2f} GiB KV cache ({} pages); step scratch {:.2f} GiB",
                          gib(in.device_total), gib(in_use), gib(in.adapter_reserve), gib(p.kv_bytes), p.kv_pages,
                          gib(in.scratch_bytes));
  return p;
}

}  // namespace moelora
