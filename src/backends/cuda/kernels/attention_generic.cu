// Paged GQA attention for head dims the tensor-core kernels are not built for (attention.cuh;
// cuda_plan::choose_attention_kernel decides): any k and v head dims that are multiples of 8 up to
// cuda_plan::kGenericAttentionMaxDim, decode and prefill tokens alike, same semantics and cache
// layout as the tensor-core kernels, after the same cache write.
//
// One warp per (token, query head), on the CUDA cores in f32 (no bf16 rounding of P: it is at least
// as close to cpu::attention as the tensor-core kernels). The warp walks the token's positions 32
// at a time: lane j scores position p0 + j against the query (held in shared memory, pre-scaled to
// the exp2 domain) with 16-byte loads of its K row; the chunk's max and sum update the online softmax
// once per chunk; then every lane accumulates its own output columns (lane + 32 i) over the chunk's
// V rows, whose cache rows and weights it takes from the scoring lanes by shuffle, so V reads are
// coalesced. Correctness for any shape, not speed, is its job: the models that need it are the ones
// the fast kernels have no instance for (docs/gpu.md).
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/attention_internal.cuh"
#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda::attention_detail {
namespace {

constexpr int kGenericWarps = 4;
constexpr int kMaxDim = cuda_plan::kGenericAttentionMaxDim;
constexpr int kColsPerLane = kMaxDim / 32;

__global__ void __launch_bounds__(kGenericWarps * 32) attn_generic_kernel(const __grid_constant__ KParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  __shared__ float q_s[kGenericWarps][kMaxDim];
  const AttentionParams& a = p.a;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int item = blockIdx.x * kGenericWarps + warp;
  if (item >= a.T * a.heads) return;  // whole warps only; no block-level synchronisation below
  const int tok = item / a.heads, h = item % a.heads, kvh = h / p.group;
  const int dk = a.k_head_dim, dv = a.v_head_dim;
  float* q = q_s[warp];
  const bf16* qg = a.q + static_cast<int64_t>(tok) * a.ld_q + static_cast<int64_t>(h) * dk;
  for (int i = lane; i < dk; i += 32) q[i] = bf16_to_float(qg[i]) * p.scale_log2;
  __syncwarp();

  const int n = a.positions[tok] + 1;  // positions 0..pos[t] of its own sequence
  const int seq_base = a.page_indptr[a.token_seq[tok]];
  const int64_t kw = static_cast<int64_t>(a.kv_heads) * dk, vw = static_cast<int64_t>(a.kv_heads) * dv;
  const bf16* k_head = a.k_cache + static_cast<int64_t>(kvh) * dk;
  const bf16* v_head = a.v_cache + static_cast<int64_t>(kvh) * dv;
  float m = -INFINITY, l = 0.0f;
  float acc[kColsPerLane];
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) acc[i] = 0.0f;

  for (int p0 = 0; p0 < n; p0 += 32) {
    const int pos = p0 + lane;
    const bool valid = pos < n;
    int64_t row = 0;
    float s = -INFINITY;
    if (valid) {
      row = cache_row(p, seq_base, pos);
      const bf16* kr = k_head + row * kw;  // 16-byte aligned: dk % 8 == 0 and the cache is
      float dot = 0.0f;
      for (int i = 0; i < dk; i += 8) {
        const uint4 u = ldg_u4(kr + i);
        dot += q[i] * bf16_bits_lo(u.x) + q[i + 1] * bf16_bits_hi(u.x) + q[i + 2] * bf16_bits_lo(u.y) +
               q[i + 3] * bf16_bits_hi(u.y) + q[i + 4] * bf16_bits_lo(u.z) + q[i + 5] * bf16_bits_hi(u.z) +
               q[i + 6] * bf16_bits_lo(u.w) + q[i + 7] * bf16_bits_hi(u.w);
      }
      s = dot;
    }
    // Lane 0 is always valid (p0 < n), so the chunk's max is finite for finite inputs.
    const float m_new = fmaxf(m, warp_max(s));
    const float alpha = exp2f(m - m_new);  // 0 on the first chunk (m = -inf)
    const float w = valid ? exp2f(s - m_new) : 0.0f;
    l = l * alpha + warp_sum(w);
    m = m_new;
#pragma unroll
    for (int i = 0; i < kColsPerLane; ++i) acc[i] *= alpha;
    const int count = min(32, n - p0);  // warp-uniform
    for (int j = 0; j < count; ++j) {
      const float wj = __shfl_sync(0xffffffffu, w, j);
      const long long rj = __shfl_sync(0xffffffffu, static_cast<long long>(row), j);
      const bf16* vr = v_head + rj * vw;
#pragma unroll
      for (int i = 0; i < kColsPerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < dv) acc[i] += wj * bf16_to_float(vr[c]);
      }
    }
  }
  const float inv = 1.0f / l;
  bf16* out = a.out + static_cast<int64_t>(tok) * a.ld_out + static_cast<int64_t>(h) * dv;
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < dv) out[c] = __float2bfloat16(acc[i] * inv);
  }
}

}  // namespace

void launch_generic(const KParams& k, cudaStream_t stream) {
  const AttentionParams& a = k.a;
  MOELORA_CHECK_MSG(cuda_plan::choose_attention_kernel(a.k_head_dim, a.v_head_dim) ==
                        cuda_plan::AttentionKernel::kGeneric,
                    "generic attention: head dims k={} v={} are not the generic kernel's", a.k_head_dim, a.v_head_dim);
  const int64_t items = static_cast<int64_t>(a.T) * a.heads;
  if (items == 0) return;
  const int blocks = static_cast<int>((items + kGenericWarps - 1) / kGenericWarps);
  launch_pdl(attn_generic_kernel, dim3(blocks), dim3(kGenericWarps * 32), 0, stream, k);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda::attention_detail
