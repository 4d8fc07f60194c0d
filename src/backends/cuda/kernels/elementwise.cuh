// Elementwise and small per-row kernels of the forward pass (embedding, RMSNorm, RoPE, SiLU·mul,
// residual add, row gathers, MLA k/v split, dtype conversion). Activations are bf16 row-major
// [rows, cols] with a row stride `ld*` in elements (column slices are views). Each launch takes
// one params struct and a stream, allocates nothing and never synchronises (CUDA-graph safe).
// Semantics are those of backends/cpu (cpu_ops.h, cpu_backend.cpp); docs/numerics.md says how
// close each lands.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

// out[t] = table[ids[t]] for t < T. An id outside [0, vocab) writes a zero row (the runtime
// validates ids before a step; the kernel never reads outside the table).
struct EmbedParams {
  const __nv_bfloat16* table = nullptr;  // [vocab, hidden]
  int64_t vocab = 0;
  int hidden = 0;
  const int32_t* ids = nullptr;  // [T] device
  int T = 0;
  __nv_bfloat16* out = nullptr;
  int64_t ld_out = 0;
};
void launch_embed(const EmbedParams& p, cudaStream_t stream);

// Each group of `group` consecutive values of each row (cols = k * group) is divided by its RMS
// and multiplied by w[0..group): y = x / sqrt(mean(x^2) + eps) * w. x and out may alias.
// group = hidden for the layer norms, = head_dim for Qwen3's per-head q/k norms.
struct RmsNormParams {
  const __nv_bfloat16* x = nullptr;
  int64_t ld_x = 0;
  const __nv_bfloat16* w = nullptr;  // [group]
  int group = 0;
  int cols = 0;
  int T = 0;
  float eps = 1e-6f;
  __nv_bfloat16* out = nullptr;
  int64_t ld_out = 0;
  // Optional residual add first (Backend::add_rmsnorm): the rounded sum bf16(x + add) is written
  // back to `sum`, which must be x itself (the residual, in place), and is what gets normalised:
  // bit for bit launch_add then launch_rmsnorm (same rounding, same reduction order; where only
  // `add` is too misaligned for the vector path the plain norm would take, launch_rmsnorm runs
  // exactly those two launches). out must not alias add or x.
  const __nv_bfloat16* add = nullptr;
  int64_t ld_add = 0;
  __nv_bfloat16* sum = nullptr;
  int64_t ld_sum = 0;
};
void launch_rmsnorm(const RmsNormParams& p, cudaStream_t stream);

// The paged KV-cache write of launch_kv_cache_write (attention.cuh), done by a rotation kernel for
// this step's kv heads so that attention runs without its own (launch_attention_no_cache_write):
// the rotated k heads, as stored in x, and v's heads go to their token's (sequence, position) row
// of the cache [pages, page_size, kv_heads * head_dim] (k and v head dims both head_dim). Off
// while k_cache is null.
struct KvCacheWrite {
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
  const __nv_bfloat16* v = nullptr;  // [T, kv_heads * head_dim]
  int64_t ld_v = 0;
  int page_size = 0;
  const int32_t* token_seq = nullptr;     // [T] device
  const int32_t* page_indptr = nullptr;   // device, CSR over sequences
  const int32_t* page_indices = nullptr;  // device
};

// In place on x [T, heads * head_stride]: rotates dims [rot_offset, rot_offset + rot_dim) of every
// head by angle = float(pos[t]) * inv_freq[i] (f32, as transformers), cos/sin times
// attention_factor. Neox pairs (i, i + rot_dim/2); interleaved pairs (2i, 2i + 1).
struct RopeParams {
  __nv_bfloat16* x = nullptr;
  int64_t ld_x = 0;
  int T = 0;
  const int32_t* positions = nullptr;  // [T] device
  int heads = 0;
  int head_stride = 0;
  int rot_offset = 0;
  int rot_dim = 0;
  bool interleaved = false;
  const float* inv_freq = nullptr;  // [rot_dim / 2] device
  float attention_factor = 1.0f;
  // Optional: heads from kv_first_head on are kv heads whose rotated values (and v) go to the cache;
  // needs the whole head rotated (rot_offset 0, rot_dim == head_stride).
  int kv_first_head = 0;
  KvCacheWrite cache;
};
void launch_rope(const RopeParams& p, cudaStream_t stream);

// Qwen3's per-head q/k norms and the rotation after them in one pass (Backend::head_norm_rope), on
// the adjacent q | k columns of a fused projection: heads [0, q_heads) use q_norm, the next
// kv_heads k_norm; each head's normed values are rounded to bf16 and then rotated (neox pairs over
// the whole head) exactly as launch_rmsnorm then launch_rope do, bit for bit. One warp per
// (token, head), the head in registers: head_dim a multiple of 64, at most 256
// (head_norm_rope_supported).
struct HeadNormRopeParams {
  __nv_bfloat16* x = nullptr;  // [T, (q_heads + kv_heads) * head_dim], in place
  int64_t ld_x = 0;
  int T = 0;
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  const __nv_bfloat16* q_norm = nullptr;  // [head_dim]
  const __nv_bfloat16* k_norm = nullptr;  // [head_dim]
  float eps = 1e-6f;
  const int32_t* positions = nullptr;  // [T] device
  const float* inv_freq = nullptr;     // [head_dim / 2] device
  float attention_factor = 1.0f;
  KvCacheWrite cache;  // optional: the kv heads' cache write in the same pass
};
bool head_norm_rope_supported(int head_dim, int rot_dim, bool interleaved);
void launch_head_norm_rope(const HeadNormRopeParams& p, cudaStream_t stream);

// out[t, i] = silu(gate[t, i]) * up[t, i] (gate and up usually column halves of one tensor).
struct SiluMulParams {
  const __nv_bfloat16* gate = nullptr;
  int64_t ld_gate = 0;
  const __nv_bfloat16* up = nullptr;
  int64_t ld_up = 0;
  int T = 0;
  int cols = 0;
  __nv_bfloat16* out = nullptr;
  int64_t ld_out = 0;
};
void launch_silu_mul(const SiluMulParams& p, cudaStream_t stream);

// inout += x (sum in f32, one rounding to bf16).
struct AddParams {
  const __nv_bfloat16* x = nullptr;
  int64_t ld_x = 0;
  __nv_bfloat16* inout = nullptr;
  int64_t ld_inout = 0;
  int T = 0;
  int cols = 0;
};
void launch_add(const AddParams& p, cudaStream_t stream);

// out[r] = x[rows[r]] for r < R; elements of `elem_bytes` (2 for bf16 activations, 4 for f32).
struct GatherRowsParams {
  const void* x = nullptr;
  int64_t ld_x = 0;  // elements
  const int32_t* rows = nullptr;  // [R] device
  int R = 0;
  int cols = 0;
  int elem_bytes = 2;
  void* out = nullptr;
  int64_t ld_out = 0;  // elements
};
void launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream);

// DeepSeek MLA: kv [T, heads*(nope+v_dim)] and the rotated k_pe [T, rope] (shared by all heads)
// give k [T, heads*(nope+rope)] = per head (k_nope, k_pe) and v [T, heads*v_dim].
struct MlaSplitKvParams {
  const __nv_bfloat16* kv = nullptr;
  int64_t ld_kv = 0;
  const __nv_bfloat16* k_pe = nullptr;
  int64_t ld_k_pe = 0;
  int T = 0;
  int heads = 0;
  int nope = 0;
  int rope = 0;
  int v_dim = 0;
  __nv_bfloat16* k = nullptr;
  int64_t ld_k = 0;
  __nv_bfloat16* v = nullptr;
  int64_t ld_v = 0;
};
void launch_mla_split_kv(const MlaSplitKvParams& p, cudaStream_t stream);

// dtype conversion of a [T, cols] matrix (f32 -> bf16 rounds to nearest even).
struct ConvertParams {
  const void* in = nullptr;
  int64_t ld_in = 0;
  void* out = nullptr;
  int64_t ld_out = 0;
  int T = 0;
  int cols = 0;
};
void launch_bf16_to_f32(const ConvertParams& p, cudaStream_t stream);
void launch_f32_to_bf16(const ConvertParams& p, cudaStream_t stream);

}  // namespace moelora::cuda
