#include "backends/cuda_plan/mla_choices.h"

#include <algorithm>
#include <cstdint>

#include "core/check.h"

namespace moelora::cuda_plan {

namespace {
size_t aligned256(size_t n) { return (n + 255) / 256 * 256; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

int mla_heads_per_block(int heads) {
  return 16 * static_cast<int>(std::clamp<int64_t>(ceil_div(heads, 16), 1, kMlaMaxHeadsPerBlock / 16));
}

MlaPlan choose_mla_plan(const MlaProblem& p) {
  MOELORA_CHECK_MSG(p.tokens >= 1 && p.heads >= 1 && p.latent >= 1 && p.v_dim >= 1 && p.max_positions >= 1 &&
                        p.lora_rank_stride >= 0,
                    "absorbed MLA plan: {} tokens, {} heads, latent {}, v {}, {} positions, LoRA ranks {}", p.tokens,
                    p.heads, p.latent, p.v_dim, p.max_positions, p.lora_rank_stride);
  MlaPlan plan;
  const size_t per_token = sizeof(float) * static_cast<size_t>(p.heads) * (p.latent + p.lora_rank_stride);
  plan.chunk_tokens = static_cast<int>(std::clamp<size_t>(kMlaScratchBudget / per_token, 1, p.tokens));
  if (p.max_chunk_tokens > 0) plan.chunk_tokens = std::min(plan.chunk_tokens, p.max_chunk_tokens);

  // A latent-attention block per SM before splitting (one fits: its query and two tiles take most
  // of the shared memory): with fewer, the SMs that have a block still walk the whole context alone.
  const int64_t blocks = int64_t{plan.chunk_tokens} * ceil_div(p.heads, mla_heads_per_block(p.heads));
  const int64_t target = int64_t{std::max(1, p.num_sms)};
  int64_t splits = 1;
  if (blocks < target) {
    const int64_t want = ceil_div(target, blocks);
    const int64_t by_positions = ceil_div(p.max_positions, kMlaMinSplitPositions);
    splits = std::min({want, by_positions, int64_t{kMlaMaxSplits}});
  }
  // The most any token of the bound uses (rounding to whole tiles may leave fewer than asked).
  plan.splits = mla_token_split(p.max_positions, static_cast<int>(splits)).count;

  // Absorption column chunks: wide where the wide grid still gives every SM two blocks, narrow
  // (4x the blocks) where it would not. Not yet measured against each other. The wide query
  // absorption's 3 % of DRAM at 64 tokens was not the chunking but one block writing every token's
  // cache row; spread over the blocks it takes 24 us there (ncu, H100, 2026-12-07, bench/RESULTS.md).
  const int64_t token_chunks = ceil_div(plan.chunk_tokens, kMlaAbsorbTokens);
  auto cols_for = [&](int n) {
    const int64_t wide_blocks = int64_t{p.heads} * ceil_div(n, 128) * token_chunks;
    return wide_blocks >= 2 * int64_t{std::max(1, p.num_sms)} ? 128 : 32;
  };
  plan.query_cols = cols_for(p.latent);
  plan.output_cols = cols_for(p.v_dim);

  const size_t rows = static_cast<size_t>(plan.chunk_tokens) * p.heads;
  plan.latent_bytes = aligned256(rows * p.latent * sizeof(float));
  if (plan.splits > 1) {
    plan.partial_bytes = aligned256(rows * plan.splits * p.latent * sizeof(float));
    plan.stats_bytes = aligned256(rows * plan.splits * 2 * sizeof(float));
  }
  plan.lora_bytes = aligned256(rows * p.lora_rank_stride * sizeof(float));
  return plan;
}

size_t mla_absorbed_weight_bytes(int layers, int heads, int nope, int v_dim, int latent) {
  auto granules = [](size_t elems) { return aligned256(std::max<size_t>(16, elems * 2)); };
  const size_t per_head = static_cast<size_t>(heads) * latent;
  return static_cast<size_t>(layers) * (granules(per_head * nope) + granules(per_head * v_dim));
}

}  // namespace moelora::cuda_plan
