// How a model and its adapters are split over tp x ep ranks (docs/multi_gpu.md).
//
// Ranks form a grid: rank = ep_rank * tp + tp_rank (the ranks of one tensor-parallel group are
// neighbours, i.e. share NVLink on a host). What each rank holds:
// - attention, dense MLPs, shared experts, embedding and lm_head: tensor parallel over the rank's
//   TP group (replicated across EP groups). Column-parallel (q/k/v or MLA q_b/kv_b by heads,
//   gate/up by intermediate rows, lm_head by vocabulary rows): W and LoRA B keep the rank's output
//   rows, LoRA A is replicated. Row-parallel (o_proj, down_proj): W and LoRA A keep the rank's
//   input columns, LoRA B is replicated; the base partial and the rank-r shrink partial are
//   all-reduced and B is applied once, after the reduce. GQA with fewer KV heads than TP ranks
//   replicates each KV head over tp / kv_heads ranks. MLA's q_a / kv_a (low-rank, shared by all
//   heads) are replicated.
// - routed experts: expert parallel over ep (rank holds experts [r*E/ep, (r+1)*E/ep) with their
//   LoRA factors; ids stay global and pairs routed elsewhere are masked, never remapped), and each
//   expert's intermediate is split over the TP group as in a dense MLP; the MoE output (routed
//   partials of every rank + the shared experts, contributed by EP group 0) is all-reduced once
//   over all tp x ep ranks.
// The functions here operate on the CPU backend's weights (float32, FP8 already dequantised); a
// GPU rank would cut FP8 weights on 128-blocks (validate_plan's fp8_block_aligned).
#pragma once

#include <memory>

#include "core/status.h"
#include "lora/adapter.h"
#include "model/model_config.h"
#include "model/model_weights.h"

namespace moelora {

struct ParallelPlan {
  int tp = 1;
  int ep = 1;
  int rank = 0;  // 0 .. world() - 1
  int world() const { return tp * ep; }
  int tp_rank() const { return rank % tp; }  // position in its tensor-parallel group
  int ep_rank() const { return rank / tp; }  // which range of routed experts it holds
};

// Whether `cfg` can be split tp x ep ways; otherwise an error naming the shape that does not
// divide. fp8_block_aligned: the weights stay FP8 on the device, so every tensor-parallel cut must
// also fall on a quantisation block boundary (each block has one scale).
Status validate_plan(const ModelConfig& cfg, int tp, int ep, bool fp8_block_aligned = false);

// What one rank holds, derived from the config and the plan.
struct RankLayout {
  ParallelPlan plan;
  // The shapes this rank stores: num_heads, num_kv_heads, intermediate_size,
  // moe_intermediate_size and num_experts are the rank's; everything else is the model's. A
  // LoraSlotPool built on it allocates the rank's LoRA tables.
  ModelConfig local;
  int q_head_begin = 0;      // query heads [q_head_begin, + local.num_heads)
  int kv_head_begin = 0;     // GQA KV heads [kv_head_begin, + local.num_kv_heads)
  int dense_inter_begin = 0; // dense MLP intermediate [begin, + local.intermediate_size)
  int moe_inter_begin = 0;   // each routed expert's intermediate [begin, + local.moe_intermediate_size)
  int shared_begin = 0;      // shared experts' width (n_shared x moe_intermediate) [begin, + local width)
  int expert_begin = 0;      // routed experts [expert_begin, + local.num_experts) of the model's num_experts
  int vocab_begin = 0;       // embedding / lm_head rows [vocab_begin, + vocab_chunk); rows past the
  int vocab_chunk = 0;       // vocabulary are zero (every rank's chunk has the same size)
};

Result<RankLayout> make_rank_layout(const ModelConfig& cfg, const ParallelPlan& plan);

// How one projection is cut for a rank: the same cut applies to its weight and its LoRA.
struct ProjectionCut {
  enum class Kind { kReplicated, kColumn, kRow } kind = Kind::kReplicated;
  int64_t begin = 0;  // kColumn: output rows [begin, begin + count); kRow: input columns
  int64_t count = 0;
};
ProjectionCut projection_cut(const ModelConfig& cfg, const RankLayout& layout, LoraTarget target);

// The rank's share of the model's weights (CPU backend weights: float32). Replicated tensors are
// shared with `full`, cut ones are copied.
ModelWeights shard_model_weights(const ModelConfig& cfg, const ModelWeights& full, const RankLayout& layout);

// The rank's share of an adapter: dense factors cut like their projections, routed-expert
// factors of the rank's experts only, with each expert's intermediate cut like its weights.
std::shared_ptr<const LoraAdapter> shard_adapter(const ModelConfig& cfg, const LoraAdapter& full,
                                                 const RankLayout& layout);

}  // namespace moelora
