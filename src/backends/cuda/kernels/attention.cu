// Paged GQA attention (see attention.cuh): the cache write, the prefill kernel and the combine of
// decode splits; the decode kernel is in attention_decode.cu.
//
// Prefill's tensor-core layout. A warp owns 16 query rows ((token, head) pairs) and walks the keys
// in tiles of 16 positions:
// - S = Q K^T: Q rows are the MMA's A operand (loaded once), K rows its B operand. The contraction
//   over head dims is permuted so that lane t owns the contiguous run [t*DK/4, (t+1)*DK/4) of a
//   head: each K row is read as 4 coalesced runs, one per lane of a quad, with 8/16-byte loads.
// - softmax online in f32, exp2 domain (scale * log2 e folded into one multiply).
// - O += P V: the S accumulators are already in the A-operand layout (P rounded to bf16, as
//   FlashAttention does); the output columns are permuted so that lane g owns the contiguous run
//   [g*DV/8, (g+1)*DV/8) of each V row: 4 V rows per lane per tile, packed pairwise with byte_perm.
// K/V loads are predicated on the position being inside the range the warp may see, so no
// unwritten cache row (possibly NaN) is ever read and no page-table entry past a sequence's end.
#include <algorithm>
#include <cmath>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/attention.cuh"
#include "backends/cuda/kernels/attention_internal.cuh"
#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda {
namespace {

using namespace attention_detail;

constexpr int kPrefillRows = kWarps * 16;

// N bf16 from `ptr` (8-byte aligned; 16-byte aligned when kWide) as N/4 pairs of bf16x2.
template <int N, bool kWide>
__device__ __forceinline__ void load_run(const bf16* ptr, bool pred, uint2 (&out)[N / 4]) {
  if constexpr (kWide) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint4 u = ldg_u4_pred(ptr + 8 * i, pred);
      out[2 * i] = make_uint2(u.x, u.y);
      out[2 * i + 1] = make_uint2(u.z, u.w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) out[i] = ldg_u2_pred(ptr + 4 * i, pred);
  }
}

// W 32-bit words from `ptr` (4-byte aligned), in the widest loads the count allows.
template <int W>
__device__ __forceinline__ void load_words(const bf16* ptr, bool pred, uint32_t (&out)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 u = ldg_u4_pred(ptr + 8 * i, pred);
      out[4 * i] = u.x, out[4 * i + 1] = u.y, out[4 * i + 2] = u.z, out[4 * i + 3] = u.w;
    }
  } else if constexpr (W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) {
      const uint2 u = ldg_u2_pred(ptr + 4 * i, pred);
      out[2 * i] = u.x, out[2 * i + 1] = u.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) out[i] = pred ? __ldg(reinterpret_cast<const unsigned int*>(ptr) + i) : 0u;
  }
}

template <int DK, int DV>
struct Attn {
  static constexpr int RL = DK / 4;   // head-dim run per lane (K, Q)
  static constexpr int S = DK / 16;   // MMA k-steps of Q K^T
  static constexpr int VR = DV / 8;   // V run per lane = number of output n-tiles
  static constexpr bool kWideK = RL % 8 == 0;
  static_assert(DK % 16 == 0 && DV % 16 == 0, "head dims");

  // Q fragments of rows g (pred v0) and g+8 (pred v1).
  static __device__ __forceinline__ void load_q(const bf16* q0, bool v0, const bf16* q1, bool v1, int t,
                                                uint32_t (&qa)[S][4]) {
    uint2 r0[S], r1[S];
    load_run<RL, kWideK>(q0 + t * RL, v0, r0);
    load_run<RL, kWideK>(q1 + t * RL, v1, r1);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      qa[s][0] = r0[s].x;
      qa[s][1] = r1[s].x;
      qa[s][2] = r0[s].y;
      qa[s][3] = r1[s].y;
    }
  }

  // K rows (positions p0 + g, p0 + 8 + g; this lane's run t) and V rows (positions p0 + 2t,
  // p0 + 2t + 1, p0 + 8 + 2t, p0 + 9 + 2t; this lane's run g) of one tile, straight from global
  // memory. Keys at pos >= kend are not loaded (zeros).
  static __device__ __forceinline__ void load_tile(const KParams& p, int seq_base, int kvh, int p0, int kend, int g,
                                                   int t, uint2 (&k0)[S], uint2 (&k1)[S], uint32_t (&vr)[4][VR / 2]) {
    const int kw = p.a.kv_heads * DK, vw = p.a.kv_heads * DV;
    {
      const bf16* kc = p.a.k_cache + kvh * DK + t * RL;
      const int pa = p0 + g, pb = p0 + 8 + g;
      const bool va = pa < kend, vb = pb < kend;
      load_run<RL, kWideK>(kc + (va ? cache_row(p, seq_base, pa) : 0) * kw, va, k0);
      load_run<RL, kWideK>(kc + (vb ? cache_row(p, seq_base, pb) : 0) * kw, vb, k1);
    }
    const bf16* vc = p.a.v_cache + kvh * DV + g * VR;
    const int vp[4] = {p0 + 2 * t, p0 + 2 * t + 1, p0 + 8 + 2 * t, p0 + 9 + 2 * t};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = vp[i] < kend;
      load_words<VR / 2>(vc + (ok ? cache_row(p, seq_base, vp[i]) : 0) * vw, ok, vr[i]);
    }
  }

  static __device__ __forceinline__ void tile(const KParams& p, int seq_base, int kvh, int p0, int kend, int lim0,
                                              int lim1, const uint32_t (&qa)[S][4], float (&m)[2], float (&l)[2],
                                              float (&o)[VR][4], int g, int t) {
    uint2 k0[S], k1[S];
    uint32_t vr[4][VR / 2];
    load_tile(p, seq_base, kvh, p0, kend, g, t, k0, k1, vr);
    compute(p, p0, kend, lim0, lim1, qa, k0, k1, vr, m, l, o, t);
  }

  // Scores, online softmax and P.V of one tile whose K / V fragments are in registers; row r sees
  // keys pos <= lim_r and pos < kend.
  static __device__ __forceinline__ void compute(const KParams& p, int p0, int kend, int lim0, int lim1,
                                                 const uint32_t (&qa)[S][4], const uint2 (&k0)[S], const uint2 (&k1)[S],
                                                 const uint32_t (&vr)[4][VR / 2], float (&m)[2], float (&l)[2],
                                                 float (&o)[VR][4], int t) {
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int i = 0; i < S; ++i) {
      mma_bf16_16816(s[0], qa[i], k0[i].x, k0[i].y);
      mma_bf16_16816(s[1], qa[i], k1[i].x, k1[i].y);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = p0 + nt * 8 + 2 * t + (e & 1);
        const int lim = e < 2 ? lim0 : lim1;
        s[nt][e] = pos <= lim && pos < kend ? s[nt][e] * p.scale_log2 : -INFINITY;
      }
    float al0, al1;
    online_softmax_step(s, m, l, al0, al1);
    const uint32_t pa[4] = {pack_bf16x2(s[0][0], s[0][1]), pack_bf16x2(s[0][2], s[0][3]),
                            pack_bf16x2(s[1][0], s[1][1]), pack_bf16x2(s[1][2], s[1][3])};
#pragma unroll
    for (int j = 0; j < VR; ++j) {
      o[j][0] *= al0;
      o[j][1] *= al0;
      o[j][2] *= al1;
      o[j][3] *= al1;
      // Element j of each lane's V run is half j%2 of word j/2; pair rows (2t, 2t+1) and (2t+8, 2t+9).
      const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;
      const uint32_t w0 = vr[0][j / 2], w1 = vr[1][j / 2], w2 = vr[2][j / 2], w3 = vr[3][j / 2];
      mma_bf16_16816(o[j], pa, __byte_perm(w0, w1, sel), __byte_perm(w2, w3, sel));
    }
  }
};

// Merges a (token, head)'s decode splits, each (o normalised by its own sum [DV], max, sum) in f32:
// out = sum_s o_s w_s / sum_s w_s with w_s = sum_s * 2^(max_s - M), M the largest max. The weights
// are taken once, one split per thread, into shared memory; then each thread sums its columns over
// the splits in split order with kCombineUnroll loads in flight (the per-thread serial loops this
// replaced read every split's max and sum again for each column and waited for memory once per
// split).
constexpr int kCombineThreads = 128;
constexpr int kCombineUnroll = 4;

__device__ __forceinline__ float block_combine(float v, float* red, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is free again
  return r;
}

template <int DV>
__global__ void __launch_bounds__(kCombineThreads) attn_combine_kernel(const __grid_constant__ KParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  __shared__ float w_split[cuda_plan::kAttentionMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  const int tok = blockIdx.x / p.a.heads, h = blockIdx.x % p.a.heads;
  const int n = p.a.positions[tok] + 1;
  const int ns = cuda_plan::attention_token_split(n, p.max_splits).count;
  const float* base = p.ws + (static_cast<int64_t>(tok) * p.a.heads + h) * p.max_splits * (DV + 2);
  float M = -INFINITY;
  for (int s = threadIdx.x; s < ns; s += kCombineThreads) M = fmaxf(M, base[s * (DV + 2) + DV]);
  M = block_combine(M, red, true);
  float W = 0.0f;
  for (int s = threadIdx.x; s < ns; s += kCombineThreads) {
    const float w = base[s * (DV + 2) + DV + 1] * exp2f(base[s * (DV + 2) + DV] - M);
    w_split[s] = w;
    W += w;
  }
  W = block_combine(W, red, false);  // its barrier also publishes w_split
  const float inv_w = 1.0f / W;
  for (int col = threadIdx.x; col < DV; col += kCombineThreads) {
    float acc = 0.0f;
    int s = 0;
    for (; s + kCombineUnroll <= ns; s += kCombineUnroll) {
      float b[kCombineUnroll];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) b[u] = base[(s + u) * (DV + 2) + col];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) acc = fmaf(b[u], w_split[s + u], acc);
    }
    for (; s < ns; ++s) acc = fmaf(base[s * (DV + 2) + col], w_split[s], acc);
    p.a.out[static_cast<int64_t>(tok) * p.a.ld_out + static_cast<int64_t>(h) * DV + col] = __float2bfloat16(acc * inv_w);
  }
}

// ---- prefill: block = (item of consecutive tokens of one sequence, kv head, row chunk)
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) attn_prefill_kernel(const __grid_constant__ KParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  using A = Attn<DK, DV>;
  const int first = p.items[2 * blockIdx.x], count = p.items[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int rows_total = count * p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rbase = blockIdx.z * kPrefillRows + warp * 16;
  if (rbase >= rows_total) return;  // no block-level synchronisation below
  const int r0 = rbase + g, r1 = r0 + 8;
  const bool v0 = r0 < rows_total, v1 = r1 < rows_total;
  const int tok0 = first + (v0 ? r0 : 0) / p.group, tok1 = first + (v1 ? r1 : 0) / p.group;
  const int h0 = kvh * p.group + (v0 ? r0 : 0) % p.group, h1 = kvh * p.group + (v1 ? r1 : 0) % p.group;
  const int lim0 = v0 ? p.a.positions[tok0] : -1, lim1 = v1 ? p.a.positions[tok1] : -1;
  const int seq_base = p.a.page_indptr[p.a.token_seq[first]];
  uint32_t qa[A::S][4];
  A::load_q(p.a.q + static_cast<int64_t>(tok0) * p.a.ld_q + static_cast<int64_t>(h0) * DK, v0,
            p.a.q + static_cast<int64_t>(tok1) * p.a.ld_q + static_cast<int64_t>(h1) * DK, v1, t, qa);
  int kend = max(lim0, lim1) + 1;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) kend = max(kend, __shfl_xor_sync(0xffffffffu, kend, o));
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[A::VR][4];
#pragma unroll
  for (int j = 0; j < A::VR; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  for (int p0 = 0; p0 < kend; p0 += 16) A::tile(p, seq_base, kvh, p0, kend, lim0, lim1, qa, m, l, o, g, t);
  float inv0, inv1;
  row_normalisers(l, v0, v1, inv0, inv1);
  bf16* out0 = p.a.out + static_cast<int64_t>(tok0) * p.a.ld_out + static_cast<int64_t>(h0) * DV;
  bf16* out1 = p.a.out + static_cast<int64_t>(tok1) * p.a.ld_out + static_cast<int64_t>(h1) * DV;
#pragma unroll
  for (int j = 0; j < A::VR; ++j) {
    const int c0 = 2 * t * A::VR + j, c1 = (2 * t + 1) * A::VR + j;
    if (v0) {
      out0[c0] = __float2bfloat16(o[j][0] * inv0);
      out0[c1] = __float2bfloat16(o[j][1] * inv0);
    }
    if (v1) {
      out1[c0] = __float2bfloat16(o[j][2] * inv1);
      out1[c1] = __float2bfloat16(o[j][3] * inv1);
    }
  }
}

// ---- cache write: one block per token.
__global__ void kv_write_kernel(const __grid_constant__ KParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int tok = blockIdx.x;
  const int seq_base = p.a.page_indptr[p.a.token_seq[tok]];
  const int64_t row = cache_row(p, seq_base, p.a.positions[tok]);
  const int kw = p.a.kv_heads * p.a.k_head_dim, vw = p.a.kv_heads * p.a.v_head_dim;
  const bf16* ks = p.a.k + static_cast<int64_t>(tok) * p.a.ld_k;
  const bf16* vs = p.a.v + static_cast<int64_t>(tok) * p.a.ld_v;
  bf16* kd = p.a.k_cache + row * kw;
  bf16* vd = p.a.v_cache + row * vw;
  for (int i = threadIdx.x; i < kw; i += blockDim.x) kd[i] = ks[i];
  for (int i = threadIdx.x; i < vw; i += blockDim.x) vd[i] = vs[i];
}

KParams make_params(const AttentionParams& a, const AttentionPlan& plan, const void* dev_meta, void* ws) {
  KParams k{};
  k.a = a;
  k.scale_log2 = a.scale * kLog2e;
  k.group = a.heads / a.kv_heads;
  k.head_tiles = (k.group + cuda_plan::attention_decode_heads_per_block(k.group) - 1) /
                 cuda_plan::attention_decode_heads_per_block(k.group);
  k.max_splits = plan.max_splits;
  k.stages = plan.stages;
  k.ps_shift = (a.page_size & (a.page_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(a.page_size)) : -1;
  k.tile_in_page = a.page_size % 16 == 0;
  k.ws = static_cast<float*>(ws);
  k.items = static_cast<const int32_t*>(dev_meta);
  k.tokens_per_item = plan.rows_per_item_tokens;
  return k;
}

template <int DK, int DV>
void launch_dims(const KParams& k, const AttentionPlan& plan, cudaStream_t stream) {
  const AttentionParams& a = k.a;
  if (plan.decode) {
    MOELORA_CHECK_MSG(a.T <= 65535, "attention decode: {} tokens exceed the grid's y extent", a.T);
    attention_prepare();
    launch_decode<DK, DV>(k, stream);
    if (plan.max_splits > 1) {
      MOELORA_CHECK_MSG(plan.max_splits <= cuda_plan::kAttentionMaxSplits, "attention: {} decode splits", plan.max_splits);
      launch_pdl(attn_combine_kernel<DV>, dim3(a.T * a.heads), dim3(kCombineThreads), 0, stream, k);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
  } else {
    if (plan.num_items == 0) return;
    if constexpr (DK % 64 == 0 && DV % 64 == 0) {
      if (plan.prefill_wgmma) {
        attention_prepare();
        return launch_prefill_wgmma<DK, DV>(k, plan.num_items, stream);
      }
    }
    const int zc = (plan.rows_per_item_tokens * k.group + kPrefillRows - 1) / kPrefillRows;
    const dim3 grid(plan.num_items, a.kv_heads, zc);
    launch_pdl(attn_prefill_kernel<DK, DV>, dim3(grid), dim3(kThreads), 0, stream, k);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

void dispatch(const KParams& k, const AttentionPlan& plan, cudaStream_t stream) {
  if (plan.generic) return launch_generic(k, stream);
  const int dk = k.a.k_head_dim, dv = k.a.v_head_dim;
  if (dk == 32 && dv == 32) return launch_dims<32, 32>(k, plan, stream);
  if (dk == 48 && dv == 32) return launch_dims<48, 32>(k, plan, stream);
  if (dk == 48 && dv == 48) return launch_dims<48, 48>(k, plan, stream);
  if (dk == 64 && dv == 64) return launch_dims<64, 64>(k, plan, stream);
  if (dk == 128 && dv == 128) return launch_dims<128, 128>(k, plan, stream);
  if (dk == 192 && dv == 128) return launch_dims<192, 128>(k, plan, stream);
  MOELORA_CHECK_MSG(false, "attention: head dims k={} v={} not built", dk, dv);
}

void check_params(const AttentionParams& a, const AttentionPlan& plan) {
  const cuda_plan::AttentionKernel kernel = cuda_plan::choose_attention_kernel(a.k_head_dim, a.v_head_dim);
  MOELORA_CHECK_MSG(kernel != cuda_plan::AttentionKernel::kUnsupported && plan.generic == (kernel == cuda_plan::AttentionKernel::kGeneric),
                    "attention: head dims k={} v={} with a plan for the {} kernel", a.k_head_dim, a.v_head_dim,
                    plan.generic ? "generic" : "tensor-core");
  MOELORA_CHECK_MSG(!plan.prefill_wgmma || (!plan.decode && cuda_plan::attention_prefill_wgmma_built(a.k_head_dim, a.v_head_dim)),
                    "attention: a wgmma prefill plan for head dims k={} v={}", a.k_head_dim, a.v_head_dim);
  MOELORA_CHECK(a.kv_heads > 0 && a.heads % a.kv_heads == 0 && a.page_size > 0);
  auto al = [](const void* ptr, int bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; };
  // Tensor-core kernels: 8-byte runs of q and of the cache rows, 16-byte ones where the run allows
  // (ld_q % 8 covers both). Generic: 16-byte K rows (k % 8 == 0 and an aligned cache).
  MOELORA_CHECK_MSG((plan.generic || (a.ld_q % 8 == 0 && al(a.q, 16))) && al(a.k_cache, 16) && al(a.v_cache, 16),
                    "attention: q rows and the caches must be 16-byte aligned");
}

}  // namespace

void attention_prepare() {
  static bool done = false;  // only the engine thread launches kernels (docs/architecture.md, data flow); idempotent
  if (done) return;
  decode_prepare<32, 32>();
  decode_prepare<48, 32>();
  decode_prepare<48, 48>();
  decode_prepare<64, 64>();
  decode_prepare<128, 128>();
  decode_prepare<192, 128>();
  prefill_wgmma_prepare<64, 64>();
  prefill_wgmma_prepare<128, 128>();
  prefill_wgmma_prepare<192, 128>();
  done = true;
}

AttentionPlan attention_plan(const int32_t* positions, const int32_t* token_seq, int T, int heads, int kv_heads,
                             int k_head_dim, int v_head_dim, const AttentionPlanOptions& opt) {
  AttentionPlan plan;
  if (cuda_plan::choose_attention_kernel(k_head_dim, v_head_dim) == cuda_plan::AttentionKernel::kGeneric) {
    plan.generic = true;  // one launch for every token: no splits, no metadata, no workspace
    plan.decode = false;
    return plan;
  }
  int max_per_seq = 0, maxn = 0;
  for (int t = 0, run = 0; t < T; ++t) {
    run = (t > 0 && token_seq[t] == token_seq[t - 1]) ? run + 1 : 1;
    max_per_seq = std::max(max_per_seq, run);
    maxn = std::max(maxn, positions[t] + 1);
  }
  plan.decode = opt.force_mode == 1 || (opt.force_mode == 0 && max_per_seq <= 1);
  const int group = heads / kv_heads;
  if (plan.decode) {
    if (opt.max_positions > 0) {
      MOELORA_CHECK_MSG(opt.max_positions >= maxn, "attention plan: max_positions {} < {}", opt.max_positions, maxn);
      maxn = opt.max_positions;
    }
    const cuda_plan::AttentionDecodeSplit split =
        cuda_plan::choose_attention_decode_split(T, kv_heads, group, maxn, opt.num_sms, k_head_dim, v_head_dim);
    plan.max_splits = split.max_splits;
    plan.stages = opt.decode_stages != 0 ? opt.decode_stages : split.stages;
    return plan;
  }
  // Prefill: consecutive tokens of one sequence, up to 64 (mma.sync) or 128 (wgmma) (token, head)
  // rows per block.
  cuda_plan::AttentionPrefillKernel kernel = cuda_plan::choose_attention_prefill(k_head_dim, v_head_dim);
  if (opt.prefill_kernel == 1) kernel = cuda_plan::AttentionPrefillKernel::kMmaSync;
  if (opt.prefill_kernel == 2) {
    MOELORA_CHECK_MSG(cuda_plan::attention_prefill_wgmma_built(k_head_dim, v_head_dim),
                      "attention plan: no wgmma prefill kernel for head dims k={} v={}", k_head_dim, v_head_dim);
    kernel = cuda_plan::AttentionPrefillKernel::kWgmma;
  }
  plan.prefill_wgmma = kernel == cuda_plan::AttentionPrefillKernel::kWgmma;
  static_assert(kPrefillRows == cuda_plan::kAttentionPrefillRowsMmaSync, "the plan's items are sized for this block");
  plan.rows_per_item_tokens = std::max(1, cuda_plan::attention_prefill_rows(kernel) / group);
  for (int t = 0; t < T;) {
    int e = t + 1;
    while (e < T && token_seq[e] == token_seq[t] && e - t < plan.rows_per_item_tokens) ++e;
    plan.meta.push_back(t);
    plan.meta.push_back(e - t);
    t = e;
  }
  plan.num_items = static_cast<int>(plan.meta.size() / 2);
  return plan;
}

size_t attention_meta_bytes(const AttentionPlan& plan) { return plan.meta.size() * sizeof(int32_t); }

void attention_upload_plan(const AttentionPlan& plan, void* dev_meta, size_t dev_bytes, cudaStream_t stream) {
  if (plan.meta.empty()) return;
  MOELORA_CHECK(attention_meta_bytes(plan) <= dev_bytes);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(dev_meta, plan.meta.data(), attention_meta_bytes(plan), cudaMemcpyHostToDevice,
                                     stream));
}

size_t attention_workspace_bytes(const AttentionPlan& plan, int T, int heads, int v_head_dim) {
  if (plan.generic || !plan.decode || plan.max_splits <= 1) return 0;
  return static_cast<size_t>(T) * heads * plan.max_splits * (v_head_dim + 2) * sizeof(float);
}

void launch_kv_cache_write(const AttentionParams& a, cudaStream_t stream) {
  if (a.T == 0) return;
  AttentionPlan none;
  const KParams k = make_params(a, none, nullptr, nullptr);
  launch_pdl(kv_write_kernel, dim3(a.T), dim3(128), 0, stream, k);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_attention_no_cache_write(const AttentionParams& a, const AttentionPlan& plan, const void* dev_meta,
                                     void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (a.T == 0) return;
  check_params(a, plan);
  MOELORA_CHECK_MSG(workspace_bytes >= attention_workspace_bytes(plan, a.T, a.heads, a.v_head_dim),
                    "attention: workspace {} B too small", workspace_bytes);
  MOELORA_CHECK(plan.generic || plan.decode || dev_meta != nullptr);
  dispatch(make_params(a, plan, dev_meta, workspace), plan, stream);
}

void launch_attention(const AttentionParams& a, const AttentionPlan& plan, const void* dev_meta, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  launch_kv_cache_write(a, stream);
  launch_attention_no_cache_write(a, plan, dev_meta, workspace, workspace_bytes, stream);
}

}  // namespace moelora::cuda
