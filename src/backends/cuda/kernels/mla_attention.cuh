// DeepSeek MLA in the absorbed form (Backend::mla_attention_absorbed; the CPU reference is
// backends/cpu/cpu_mla.cpp). The KV cache holds each position's latent c [R] and rotated k_pe
// [rope] as one bf16 row of R + rope values; kv_b never expands it. Per query head h:
//   qc_h = W_UK_h^T q_nope_h + A^T (B_UK_h^T q_nope_h)                      [R]
//   s_j  = scale * (qc_h . c_j + q_pe_h . k_pe_j),  o_h = sum_j softmax_j(s) c_j     [R]
//   out_h = W_UV_h o_h + B_UV_h (A o_h)                                       [v_dim]
// with A / B the token's kv_b LoRA factors (slot -1 or rank 0: none).
//
// Kernels, in launch order, per pass over at most plan.chunk_tokens tokens (cuda_plan::MlaPlan),
// each launched with programmatic dependent launch:
//  1. query_absorb   (heads x column chunks x 64-token chunks, bf16 tensor cores): qc = W_UK_h^T
//                    q_nope into float32 scratch; the column-chunk-0 blocks also write the tokens' (c, k_pe)
//                    into their cache rows, token tt by head block tt mod heads.
//  2. lora_query     (tokens x 2-head groups, only with kv_b LoRA): qc += A^T (B_UK_h^T q_nope).
//  3. latent_attention (tokens x head groups of up to 64 x KV splits, bf16 tensor cores): qc rounded
//                    to bf16 as the query; S = Q K^T and O += P V over tiles of 64 cache rows in
//                    shared memory; online softmax in the exp2 domain, P rounded to bf16; o in
//                    float32 over qc in place (one split) or partial (m, l, o); a token uses
//                    cuda_plan::mla_token_split(its context, the grid's splits) of them.
//  4. merge_splits   (only with splits > 1): o = sum_s w_s o_s / sum_s w_s l_s over qc's scratch.
//  5. lora_output_shrink (tokens x 2-head groups, only with kv_b LoRA): u = A o per head (float32 o).
//  6. output_absorb  (heads x column chunks x 64-token chunks, bf16 tensor cores): out = W_UV_h o
//                    (o rounded to bf16) + B_UV_h u, rounded once to bf16.
// qc and o stay float32 between kernels; the tensor-core kernels round their operands to bf16 once
// (qc and P in the attention, o in the output absorption; docs/numerics.md has the bound).
// Launches allocate nothing and never synchronise (CUDA-graph safe): scratch comes from the caller.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda_plan/mla_choices.h"

namespace moelora::cuda {

struct MlaAbsorbedParams {
  // Activations (bf16, row strides in elements).
  const __nv_bfloat16* q = nullptr;  // [T, heads * (nope + rope)], rope dims rotated
  int64_t ld_q = 0;
  const __nv_bfloat16* latent = nullptr;  // [T, R] (after kv_a_norm)
  int64_t ld_latent = 0;
  const __nv_bfloat16* k_pe = nullptr;  // [T, rope], rotated
  int64_t ld_k_pe = 0;
  __nv_bfloat16* out = nullptr;  // [T, heads * v_dim]
  int64_t ld_out = 0;
  int T = 0;
  int heads = 0;
  int nope = 0;
  int rope = 0;
  int v_dim = 0;
  int R = 0;  // kv_lora_rank
  float scale = 1.0f;
  // kv_b in the kernels' layouts (MlaWeightPrep), both [head][output column][reduction]:
  // W_UK transposed [heads][R][nope] and W_UV [heads][v_dim][R].
  const __nv_bfloat16* w_uk_t = nullptr;
  const __nv_bfloat16* w_uv = nullptr;
  // kv_b's LoRA tables (LoraModuleTable on the device: A [rank, R], B [heads * (nope + v_dim), rank],
  // bf16 element pointers). lora_a == nullptr: no LoRA in this call.
  const int64_t* lora_a = nullptr;
  const int64_t* lora_b = nullptr;
  const int32_t* lora_rank = nullptr;
  int lora_slots = 0;
  int lora_rank_stride = 0;  // >= every rank in the tables (the plan's LoRA scratch width)
  // Latent cache [pages, page_size, R + rope] and the step's metadata (device).
  __nv_bfloat16* cache = nullptr;
  int page_size = 0;
  const int32_t* positions = nullptr;     // [T]
  const int32_t* token_seq = nullptr;     // [T]
  const int32_t* token_slot = nullptr;    // [T] adapter slot or -1
  const int32_t* page_indptr = nullptr;   // [num_seqs + 1]
  const int32_t* page_indices = nullptr;  // CSR page tables (as in attention.cuh)
};

// Writes the cache rows, then attention and both absorptions, in passes of plan.chunk_tokens tokens.
// `scratch` holds plan.scratch_bytes() (256-byte aligned).
void launch_mla_absorbed(const MlaAbsorbedParams& p, const cuda_plan::MlaPlan& plan, void* scratch,
                         size_t scratch_bytes, cudaStream_t stream);

// Raises the kernels' shared-memory limits; once, before any capture (CudaBackend's constructor).
void mla_prepare();

// kv_b [heads * (nope + v_dim), R] (FP8 e4m3 with block scales, or bf16) -> the bf16 copies the
// kernels read, each [head][output column][reduction] so that a tensor-core B fragment is two
// 32-bit loads: W_UK transposed ([heads][R][nope]: qc's columns are R, the sum runs over nope)
// and W_UV as kv_b holds it ([heads][v_dim][R]). FP8 is dequantised exactly in float32 (code x
// scale, as dequantize_fp8_block) and rounded once to bf16.
struct MlaWeightPrep {
  const void* w = nullptr;
  bool fp8 = false;
  const float* scale_inv = nullptr;  // FP8: [row blocks, ceil(R / block_in)]
  int block_out = 128;
  int block_in = 128;
  int split_rows = 0;
  int heads = 0;
  int nope = 0;
  int v_dim = 0;
  int R = 0;
  __nv_bfloat16* w_uk_t = nullptr;  // [heads * R * nope]
  __nv_bfloat16* w_uv = nullptr;    // [heads * v_dim * R]
};
void launch_mla_prepare_weights(const MlaWeightPrep& p, cudaStream_t stream);

}  // namespace moelora::cuda
