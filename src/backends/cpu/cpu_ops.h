// The CPU reference: every op as plain loops over float32 data with float64 accumulation.
// This is the executable specification that the fixtures judge and that every CUDA kernel is
// checked against (tests/ops). Keep it obvious; speed is not its job.
//
// Each token's result depends only on that token's inputs (and its own sequence's KV cache), so
// a batch that mixes adapters reproduces each request run alone bit for bit.
#pragma once

#include <cstdint>

#include <vector>

#include "ops/sampling.h"
#include "ops/types.h"

namespace moelora::cpu {

// ---- Sampling: Backend::sample (backend.h) on rows of `ld`-strided f32 logits.
std::vector<SampleOutput> sample(const float* logits, int64_t ld, int vocab, const std::vector<SampleRow>& rows);

// ---- Numerics helpers
// Per-token, per-`group`-channel e4m3 quantisation with scale = amax / 448 (what the GPU does to
// activations before an FP8 GEMM): q[t][c] = fp8(x[t][c] / scale[t][c / group]).
void quantize_fp8_per_token_group(const float* x, int64_t rows, int cols, int group, uint8_t* q,
                                  float* scales);
// What a W8A8 GEMM multiplies instead of x [rows, cols] (row stride ld): each row quantised as
// quantize_fp8_per_token_group does (groups of 128) and dequantised, out[t][c] = e4m3(q) * scale
// (exact in double), packed [rows, cols].
void fp8_activation_round_trip(const float* x, int64_t ld, int64_t rows, int cols, double* out);

// ---- Dense
// y[t] = x[t] W^T for t < T;  W [out, in].
void linear(const float* x, int64_t ldx, int64_t T, const float* w, int out, int in, float* y, int64_t ldy);
// y[t] += B_s (A_s x[t]) for s = slot[t] >= 0 with rank > 0 in `table` (host pointers, f32).
void lora_add(const float* x, int64_t ldx, int64_t T, const int32_t* slot, const LoraModuleTable& table,
              float* y, int64_t ldy);
// Groups of `group` values in each row normalised by their RMS, times w[group].
void rmsnorm(const float* x, int64_t ldx, int64_t T, int cols, const float* w, int group, float eps,
             float* y, int64_t ldy);
void silu_mul(const float* gate, int64_t ldg, const float* up, int64_t ldu, int64_t T, int cols, float* out,
              int64_t ldo);

// ---- Attention
// Row of the paged cache that holds position `pos` of sequence `seq` (b.seq_pages: its pages).
int64_t cache_row(const StepBatch& b, int seq, int pos, int page_size);
// Attention scores p[0..n) -> softmax weights in place: exp(p_j - max p) / sum, in f64.
void softmax_weights(double* p, int n);
void rope(float* x, int64_t ldx, int64_t T, const int32_t* positions, int heads, int head_stride,
          int rot_offset, const RopeTable& rope);
struct AttentionArgs {
  const float* q; int64_t ldq;
  const float* k; int64_t ldk;
  const float* v; int64_t ldv;
  float* out; int64_t ldo;
  int64_t T;
  int heads;
  float scale;
  const int32_t* positions;
  const int32_t* token_seq;
  const StepBatch* batch;  // page tables
};
// Writes k/v of every token into the cache, then causal attention (see Backend::attention).
void attention(const AttentionArgs& a, KvLayer& kv);
// DeepSeek MLA in the absorbed form (see Backend::mla_attention_absorbed): the cache holds
// (c, k_pe) per position; kv_b and its LoRA are applied on the query and output sides.
struct MlaAbsorbedArgs {
  const float* q; int64_t ldq;            // [T, heads * (nope + rope)], rope dims rotated
  const float* latent; int64_t ldc;       // [T, R]  (R = kv_lora_rank)
  const float* k_pe; int64_t ldpe;        // [T, rope], rotated
  const float* w_kv_b;                    // [heads * (nope + v_dim), R]
  const LoraModuleTable* lora;            // kv_b's (in R, out heads * (nope + v_dim)); nullptr = none
  float* out; int64_t ldo;                // [T, heads * v_dim]
  int64_t T;
  int heads, nope, rope, v_dim, R;
  float scale;
  const int32_t* positions;
  const int32_t* token_seq;
  const int32_t* slot;                    // [T] adapter slot or -1
  const StepBatch* batch;                 // page tables
};
void mla_attention_absorbed(const MlaAbsorbedArgs& a, KvLayer& kv);

// ---- Routing and experts
void topk_softmax(const float* logits, int64_t T, int E, int k, bool renormalize, int32_t* ids, float* w);
void topk_sigmoid_grouped(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                          int topk_group, bool renormalize, float scaling, int32_t* ids, float* w);
struct MoeArgs {
  const float* x; int64_t ldx;
  int64_t T;
  int k;
  const int32_t* ids;     // [T, k]
  const float* weights;   // [T, k]
  const int32_t* slot;    // [T]
  const float* w_gate_up; // [E, 2I, H]
  const float* w_down;    // [E, H, I]
  int E, H, I;
  const MoeLoraTable* lora;  // nullptr = none (host pointers, f32)
  float* out; int64_t ldo;
  // Expert parallelism (src/parallel): the weights above, and the LoRA table's per-expert strides,
  // hold experts [expert_begin, expert_begin + E) of a layer of `global_experts`. ids stay global;
  // a pair whose expert lies outside that range belongs to another rank and contributes nothing
  // here: it is masked, never mapped onto a local expert's (or another adapter's) weights.
  // global_experts == 0: no expert parallelism, the weights hold the whole layer.
  int expert_begin = 0;
  int global_experts = 0;
  // W8A8, the CUDA FP8 experts' regime from 16-token tiles on (docs/numerics.md): the base GEMMs
  // read their inputs quantised per token per 128 channels to e4m3 (quantize_fp8_per_token_group)
  // and dequantised, the down input rounded to bf16 first as the GPU stores it; LoRA reads the
  // unquantised inputs. Off: the exact W8A16 / f32 semantics.
  bool fp8_activations = false;
};
void moe(const MoeArgs& a);

}  // namespace moelora::cpu
