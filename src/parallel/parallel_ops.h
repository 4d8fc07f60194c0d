// The per-rank building blocks of a sharded forward pass that involve a collective or a mask: the
// row-parallel projection with its LoRA, vocabulary-parallel embedding and logits, and the routed
// experts of one EP rank. Each is the CPU reference op (backends/cpu) on the rank's shard plus
// the reduction that makes the sum over ranks equal the unsharded result.
#pragma once

#include <cstdint>

#include "ops/backend.h"
#include "parallel/communicator.h"

namespace moelora {

// ---- Row-parallel projection (o_proj, down_proj): x and W are cut along the input dimension.
//   out = sum_ranks(x_p W_p^T) + B_s (sum_ranks(A_s,p x_p))       for s = slot[t] >= 0
// The rank-r shrink partials travel in the same all-reduce as the base partials (one collective);
// B is applied once, after the reduce, on every rank (so all ranks hold the same out).

// Columns the shrink partials take in the reduce buffer: the table's largest rank over all slots
// (fixed by the loaded adapters, not by the batch: the buffer shape never depends on who is in it).
int row_parallel_lora_width(const LoraModuleTable* lora);
// Writes the rank's partials into partial [T, w.out + row_parallel_lora_width(lora)]: columns
// [0, w.out) x W_p^T, then each token's shrink u = A_s,p x (zero past its rank; zero for slot -1).
void row_parallel_partial(Backend& b, const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora,
                          const int32_t* slots, Tensor partial);
// After `reduced` (a partial buffer) was all-reduced: out[t] = reduced[t, :out] + B_s u[t].
void row_parallel_expand(const Tensor& reduced, const LoraModuleTable* lora, const int32_t* slots, Tensor out);
// The three steps above over `comm` (a group of one rank: the plain fused projection).
void row_parallel_linear(Backend& b, Communicator& comm, const Tensor& x, const LinearWeight& w,
                         const LoraModuleTable* lora, const int32_t* slots, Tensor out);

// ---- Vocabulary-parallel embedding and logits (the TP group splits the vocabulary rows).
// out[t] = shard[id - vocab_begin] when this rank holds token id, else 0; then all-reduced (one
// rank holds each id, so the sum is that row exactly).
void vocab_parallel_embed(const Tensor& shard, int vocab_begin, const std::vector<int32_t>& token_ids,
                          Communicator& comm, Tensor out);
// logits [R, vocab] = every rank's rows W_p x, gathered (W_p: vocab_chunk rows, zero past vocab).
void vocab_parallel_logits(Backend& b, Communicator& comm, const Tensor& x, const LinearWeight& shard, int vocab,
                           Tensor logits);

// ---- Routed experts of one EP rank: `local` holds experts [expert_begin, + local.num_experts)
// (each possibly an intermediate slice), `lora` their factors. ids are global; a pair whose expert
// another rank holds contributes exactly nothing here. out [T, H] is overwritten with this rank's
// partial: sum over its pairs of w * (base + LoRA), to be all-reduced with the other ranks'.
void expert_parallel_moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const int32_t* slots,
                         const ExpertWeights& local, const MoeLoraTable* lora, int expert_begin, int global_experts,
                         Tensor out);

}  // namespace moelora
