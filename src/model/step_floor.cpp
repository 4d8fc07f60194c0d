#include "model/step_floor.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "model/archs.h"

namespace moelora {

namespace {

// Bytes per stored weight of the model's linears on the device (bf16 for the float formats).
double weight_bytes(const ModelConfig& c) {
  return c.weight_format.is_dense() ? 2.0 : c.weight_format.bytes_per_weight();
}

// Which projections of a layer a floor counts.
enum class Projections { kAttention, kDenseMlp, kSharedExperts };

Projections group_of(LoraTarget t) {
  switch (t) {
    case LoraTarget::kSharedGate:
    case LoraTarget::kSharedUp:
    case LoraTarget::kSharedDown: return Projections::kSharedExperts;
    case LoraTarget::kGate:
    case LoraTarget::kUp:
    case LoraTarget::kDown: return Projections::kDenseMlp;
    default: return Projections::kAttention;
  }
}

// The projections of layer `l` in `group` and the LoRA factors of `adapters` adapters on them:
// every adapter reads its whole A and B of each target.
double projection_bytes(const ModelConfig& c, int l, int adapters, int rank, Projections group) {
  double total = 0;
  for (int t = 0; t < kNumLoraTargets; ++t) {
    const auto target = static_cast<LoraTarget>(t);
    if (group_of(target) != group) continue;
    auto [in, out] = lora_target_shape(c, l, target);
    if (in == 0) continue;
    total += static_cast<double>(in) * out * weight_bytes(c) + adapters * 2.0 * rank * (in + out);
  }
  return total;
}

// The cache bytes of `tokens` sequences x `positions` positions x `layers` layers, in the model's
// layout (Model::kv_shape: per-head K and V, or an MLA latent), bf16.
double cache_bytes(const KvShape& kv, int tokens, int positions, int layers) {
  return static_cast<double>(tokens) * positions * layers * static_cast<double>(kv.values_per_token()) * 2.0;
}

}  // namespace

double expected_distinct_experts(const ModelConfig& c, double tokens) {
  const double E = c.num_experts, k = c.top_k;
  return E * (1.0 - std::pow(1.0 - k / E, tokens));
}

double moe_block_floor_bytes(const ModelConfig& c, int layer, int tokens, int adapters, int rank) {
  MOELORA_CHECK_MSG(layer >= 0 && layer < c.num_layers && c.layer_is_moe[layer], "layer {} is not a MoE layer", layer);
  const double H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const int n_eff = std::min(adapters, tokens);
  double total = 2.0 * E * H + expected_distinct_experts(c, tokens) * 3 * H * I * weight_bytes(c);
  // Each adapter's tokens touch their own experts: the sum over adapters of D(its tokens).
  double pairs = 0;
  for (int a = 0; a < n_eff; ++a) pairs += expected_distinct_experts(c, static_cast<double>(tokens) / n_eff);
  total += pairs * 2.0 * rank * (2 * H + 3 * I);
  return total + projection_bytes(c, layer, n_eff, rank, Projections::kSharedExperts);
}

double decode_step_floor_bytes(const ModelConfig& c, const KvShape& kv, int tokens, int adapters, int rank,
                               int context) {
  const int n_eff = std::min(adapters, tokens);
  double total = 2.0 * c.vocab_size * c.hidden_size;  // bf16 lm_head
  for (int l = 0; l < c.num_layers; ++l) {
    total += projection_bytes(c, l, n_eff, rank, Projections::kAttention) +
             projection_bytes(c, l, n_eff, rank, Projections::kDenseMlp);
    if (c.layer_is_moe[l]) total += moe_block_floor_bytes(c, l, tokens, adapters, rank);
  }
  total += cache_bytes(kv, tokens, context, c.num_layers);  // read
  return total;
}

double attention_block_floor_bytes(const ModelConfig& c, const KvShape& kv, int layer, int tokens, int adapters,
                                   int rank, int context) {
  MOELORA_CHECK_MSG(layer >= 0 && layer < c.num_layers, "layer {} of {}", layer, c.num_layers);
  const int n_eff = std::min(adapters, tokens);
  // Read: `context` cached positions per sequence; written: the step's own token per sequence.
  return projection_bytes(c, layer, n_eff, rank, Projections::kAttention) + cache_bytes(kv, tokens, context + 1, 1);
}

}  // namespace moelora
