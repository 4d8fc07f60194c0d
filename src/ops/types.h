// Op contracts, part 1: the plain data that ops read. No backend code here: the CPU reference
// (backends/cpu) and the CUDA kernels (backends/cuda) both consume these structs.
//
// Conventions
// - Activations are 2-D row-major [tokens, width]; the backend picks their dtype (CPU: f32).
// - Linear weights are [out, in] as in PyTorch: y = x W^T.
// - FP8 weights carry `scale_inv` with W[i][j] = W_fp8[i][j] * scale_inv[i / bo][j / bi].
// - LoRA factors follow PEFT: A [rank, in], B [out, rank]; the adapter's scale s (alpha/r or
//   alpha/sqrt(r)) is folded into B when an adapter is loaded, so ops never see s.
// - Every token carries its adapter slot, or -1 for the base model.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace moelora {

// A projection's base weight on some backend.
struct LinearWeight {
  Tensor w;          // [out, in]; f32 on the CPU backend, f8/bf16 on CUDA
  Tensor scale_inv;  // undefined unless w is FP8: [row_blocks, ceil(in / block_in)] f32
  int out = 0;
  int in = 0;
  int block_out = 128;
  int block_in = 128;
  // When > 0 the rows [0, split_rows) and [split_rows, out) were quantised as separate matrices
  // (a fused gate|up whose halves came from two checkpoint tensors): row r uses scale row
  //   r < split ? r / block_out : ceil(split / block_out) + (r - split) / block_out.
  int split_rows = 0;
  // NVFP4 weights a backend keeps in 4 bits (CUDA's routed experts): w holds the e2m1 codes (U8
  // [out, in / 2]) and these their scales, all in that backend's kernel order
  // (backends/cuda_plan/nvfp4_layout.h): e4m3 group scales (U8) and f32 global scales per part.
  Tensor group_scale;
  Tensor global_scale;
  bool defined() const { return w.defined(); }
};

// Projections fused row-wise (Backend::fuse_linear_rows): the split_rows their concatenation needs
// so that every row keeps its own FP8 scale row (`block_scaled`), or -1 when it cannot: every
// boundary between parts but the last must fall on a block_out boundary (the last one becomes
// split_rows; 0 when it is aligned too), and no part may be split already. Dense weights: always 0.
int fused_split_rows(const std::vector<const LinearWeight*>& parts, bool block_scaled);

// Routed experts of one MoE layer, packed expert-major.
struct ExpertWeights {
  int num_experts = 0;
  int hidden = 0;        // H
  int intermediate = 0;  // I
  LinearWeight gate_up;  // w: [E * 2I, H]; expert e owns rows [e*2I, (e+1)*2I): gate then up
  LinearWeight down;     // w: [E * H, I]
};

// One projection's LoRA across all adapter slots. Slot s uses A = a_ptr[s] ([rank[s], in]) and
// B = b_ptr[s] ([out, rank[s]], scaled); rank 0 means "this adapter has no LoRA here".
// The pointer tables live where the backend's kernels can read them (device memory on CUDA);
// `host_rank` mirrors the ranks for planning on the host.
struct LoraModuleTable {
  int num_slots = 0;
  int in = 0;
  int out = 0;
  Tensor a_ptrs;  // I64 [num_slots]: element pointers (backend's LoRA dtype)
  Tensor b_ptrs;  // I64 [num_slots]
  Tensor ranks;   // I32 [num_slots]
  std::vector<int> host_rank;
};

// Makes the tensors of a table with a backend's allocator (zeroed [n] tensors of a dtype), so
// every backend lays tables out the same way.
using TableAlloc = std::function<Tensor(DType dtype, int64_t n)>;
LoraModuleTable make_lora_table(int num_slots, int in, int out, const TableAlloc& alloc);

// Routed-expert LoRA of one MoE layer across slots. For slot s and expert e:
//   gate_up: A = gu_a[s] + e * gu_a_expert_stride[s]   ([r_gu, H]; stride 0 = shared by experts)
//            B = gu_b[s] + e * gu_b_expert_stride[s]   ([2I, r_gu])
//   down:    A = d_a[s]  + e * d_a_expert_stride[s]    ([r_d, I])
//            B = d_b[s]  + e * d_b_expert_stride[s]    ([H, r_d]; stride 0 = shared by experts)
// Strides are in elements. A rank of 0 disables that half for the slot.
struct MoeLoraTable {
  int num_slots = 0;
  int num_experts = 0;
  int hidden = 0;
  int intermediate = 0;
  // I64 [num_slots] each.
  Tensor gu_a, gu_a_expert_stride, gu_b, gu_b_expert_stride;
  Tensor d_a, d_a_expert_stride, d_b, d_b_expert_stride;
  Tensor gu_rank, d_rank;  // I32 [num_slots]
  std::vector<int> host_gu_rank, host_d_rank;
};

MoeLoraTable make_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate, const TableAlloc& alloc);

// Paged KV cache of one layer: page p holds `page_size` consecutive positions of one sequence.
// MLA in the absorbed form (Backend::mla_attention_absorbed) keeps the latent instead: kv_heads 1,
// k_head_dim kv_lora_rank + rope (c, then k_pe), v_head_dim 0 (v is an empty tensor).
struct KvLayer {
  Tensor k;  // [num_pages, page_size, kv_heads * k_head_dim]
  Tensor v;  // [num_pages, page_size, kv_heads * v_head_dim]
  int page_size = 0;
  int kv_heads = 0;
  int k_head_dim = 0;
  int v_head_dim = 0;
};

// One forward step as the backend sees it (built by the runtime's batch planner).
// Tokens of one sequence are contiguous and in position order.
struct StepBatch {
  std::vector<int32_t> token_ids;    // [T]
  std::vector<int32_t> positions;    // [T] absolute position in its sequence
  std::vector<int32_t> token_seq;    // [T] index into seq_*
  std::vector<int32_t> token_slot;   // [T] adapter slot or -1
  std::vector<std::vector<int32_t>> seq_pages;  // page table per sequence (covers all positions used)
  std::vector<int32_t> logit_rows;   // tokens whose logits the step returns, in output order
  int num_tokens() const { return static_cast<int>(token_ids.size()); }
  int num_seqs() const { return static_cast<int>(seq_pages.size()); }
};

// Rotary embedding as the model computes it: inv_freq per rotated pair and a multiplier on
// cos/sin (YaRN's attention factor; 1 otherwise).
struct RopeTable {
  std::vector<float> inv_freq;  // [rot_dim / 2]
  float attention_factor = 1.0f;
  int rot_dim = 0;
  bool interleaved = false;  // rotate (x[2i], x[2i+1]) instead of (x[i], x[i + rot_dim/2])
};

}  // namespace moelora
