// The bytes a decode step, or one MoE or attention block of it, must move at least (docs/floors.md): weights
// touched, LoRA factors touched and the KV cache read, with the weights as the device holds them
// (FP8 stays FP8, NVFP4 4-bit, the float types bf16). Benchmarks divide these by a bandwidth to get
// their floors (`moelora bench`, dev/moe_block.cu, dev/attention_block.cu), so both read one formula.
#pragma once

#include "model/model.h"
#include "model/model_config.h"

namespace moelora {

// Expected number of distinct experts `tokens` tokens route to, each picking top_k of
// num_experts uniformly: E (1 - (1 - k/E)^tokens).
double expected_distinct_experts(const ModelConfig& c, double tokens);

// One MoE block of layer `layer` (which must be a MoE layer) for `tokens` tokens spread evenly
// over `adapters` distinct adapters (0 = base) of rank `rank` on every target: the router (bf16),
// the expected distinct routed experts, the shared experts, and the LoRA factors of each
// adapter's own distinct experts and of the shared experts. Activations (a few MB at 256 tokens)
// are left out.
double moe_block_floor_bytes(const ModelConfig& c, int layer, int tokens, int adapters, int rank);

// The attention of layer `layer` for `tokens` decoding sequences with `context` cached positions
// each: its projections (q|k|v and o, or MLA's) with the LoRA factors of min(adapters, tokens)
// adapters, the cache read and the step's own cache write, in `kv`'s layout (bf16). Activations
// and norm weights (a few KB at one token) are left out.
double attention_block_floor_bytes(const ModelConfig& c, const KvShape& kv, int layer, int tokens, int adapters,
                                   int rank, int context);

// One decode step of `tokens` sequences with `context` tokens of KV cache each: the bf16 lm_head,
// every layer's projections and their LoRA, the MoE blocks as above, and the cache in `kv`'s
// layout (bf16).
double decode_step_floor_bytes(const ModelConfig& c, const KvShape& kv, int tokens, int adapters, int rank,
                               int context);

}  // namespace moelora
