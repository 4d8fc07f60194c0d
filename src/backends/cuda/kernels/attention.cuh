// Paged causal attention with GQA, semantics of cpu::attention: every token's k/v is first written
// into the paged cache at (its sequence, its position), then each query head h of token t attends
// to positions 0..pos[t] of its own sequence through kv head h / (heads / kv_heads):
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . K[j]) V[j].
// Cache layout (KvLayer): k [num_pages, page_size, kv_heads * k_head_dim], v likewise with
// v_head_dim (bf16). Page tables in CSR form: sequence s owns pages
// page_indices[page_indptr[s] .. page_indptr[s+1]), position p lives in page (p / page_size), row
// p % page_size. Head dims: any k that is a multiple of 8 and any v, both up to 256
// (cuda_plan::choose_attention_kernel).
//
// For the head dims they are built for (cuda_plan::kTensorCoreHeadDims), two kernels on the tensor
// cores (bf16 MMA, f32 softmax in the exp2 domain):
// - decode (attention_decode.cu): one block per (token, kv head x 8 or 16 of its query heads, KV
//   split); the block's 4 warps split the split's positions, K/V tiles staged in shared memory by
//   cp.async and read once per group of query heads, which are the MMA's columns; splits are
//   merged by a combine kernel (flash-decoding). Any token can go this way.
// - prefill: one block per (<= 64 (token, head) rows of one sequence, kv head); each warp walks the
//   positions its rows may see, with a per-row causal limit. For head dims that are multiples of
//   64, a wgmma kernel (attention_prefill_wgmma.cu: 128 rows per block, K/V tiles shared in shared
//   memory) where cuda_plan::choose_attention_prefill takes it.
// Other head dims: attention_generic.cu, one warp per (token, head) on the CUDA cores, every token.
// attention_plan() picks the kernel and the split size on the host; launches allocate nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace moelora::cuda {

struct AttentionParams {
  const __nv_bfloat16* q = nullptr;  // [T, heads * k_head_dim]
  int64_t ld_q = 0;
  const __nv_bfloat16* k = nullptr;  // [T, kv_heads * k_head_dim]: this step's keys
  int64_t ld_k = 0;
  const __nv_bfloat16* v = nullptr;  // [T, kv_heads * v_head_dim]
  int64_t ld_v = 0;
  __nv_bfloat16* out = nullptr;  // [T, heads * v_head_dim]
  int64_t ld_out = 0;
  int T = 0;
  int heads = 0;
  float scale = 1.0f;
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
  int page_size = 0;
  int kv_heads = 0;
  int k_head_dim = 0;
  int v_head_dim = 0;
  const int32_t* positions = nullptr;     // device [T]
  const int32_t* token_seq = nullptr;     // device [T]
  const int32_t* page_indptr = nullptr;   // device [num_seqs + 1]
  const int32_t* page_indices = nullptr;  // device [page_indptr[num_seqs]]
};

// Raises the decode kernels' dynamic shared-memory limits (function attributes, not stream
// operations). Launches call it themselves; call it once at start-up so that no first launch
// happens inside a stream capture.
void attention_prepare();

struct AttentionPlanOptions {
  int num_sms = 132;
  // 0: decode kernel when every sequence brings one token, prefill kernel otherwise.
  // 1: always decode; 2: always prefill.
  int force_mode = 0;
  // Decode: size the KV splits for this many positions instead of the batch's longest (a graph
  // captured for a bucket passes its largest context, so the grid stays fixed).
  int max_positions = 0;
  // Workbench override of cuda_plan's pipeline depth for decode (0 = the choice; 2..4).
  int decode_stages = 0;
  // Tests' and the workbench's override of cuda_plan::choose_attention_prefill: 0 = the choice,
  // 1 = the mma.sync kernel, 2 = the wgmma kernel (where cuda_plan::attention_prefill_wgmma_built).
  int prefill_kernel = 0;
};

struct AttentionPlan {
  bool generic = false;  // attention_generic.cu for every token (head dims without a tensor-core instance)
  bool decode = true;
  int max_splits = 1;  // decode: splits of the longest sequence (each token's own: attention_token_split)
  int stages = 2;      // decode: K/V tiles per warp in shared memory
  bool prefill_wgmma = false;  // prefill: attention_prefill_wgmma.cu (else attention.cu's mma.sync kernel)
  int num_items = 0;   // prefill: blocks along the token axis
  int rows_per_item_tokens = 0;
  std::vector<int32_t> meta;  // prefill: [first token, token count] per item (upload to the device)
};

// positions / token_seq: host copies of the step's arrays.
AttentionPlan attention_plan(const int32_t* positions, const int32_t* token_seq, int T, int heads, int kv_heads,
                             int k_head_dim, int v_head_dim, const AttentionPlanOptions& opt = {});
size_t attention_meta_bytes(const AttentionPlan& plan);
void attention_upload_plan(const AttentionPlan& plan, void* dev_meta, size_t dev_bytes, cudaStream_t stream);
// Split-KV partials of the decode kernel: [T][heads][max_splits] x (v_head_dim + 2) floats.
size_t attention_workspace_bytes(const AttentionPlan& plan, int T, int heads, int v_head_dim);

// Writes this step's k/v into the cache (part of launch_attention; exposed for tests/benches).
void launch_kv_cache_write(const AttentionParams& p, cudaStream_t stream);
// Cache write, then attention (+ split combine). dev_meta: the uploaded plan (prefill only).
void launch_attention(const AttentionParams& p, const AttentionPlan& plan, const void* dev_meta, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);
// Attention alone (the cache already holds every position): the decode bench times this.
void launch_attention_no_cache_write(const AttentionParams& p, const AttentionPlan& plan, const void* dev_meta,
                                     void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace moelora::cuda
