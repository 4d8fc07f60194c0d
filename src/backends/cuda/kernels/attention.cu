// Paged GQA attention (see attention.cuh).
//
// Tensor-core layout shared by both kernels. A warp owns 16 query rows (heads of one token for
// decode, (token, head) pairs for prefill) and walks the keys in tiles of 16 positions:
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
#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPrefillRows = kWarps * 16;
constexpr float kLog2e = 1.4426950408889634f;

struct KParams {
  AttentionParams a;
  float scale_log2;
  int group;       // query heads per kv head
  int head_tiles;  // ceil(group / 16)
  int chunk;
  int max_splits;
  int ps_shift;  // log2(page_size) when a power of two, else -1
  float* ws;
  const int32_t* items;
  int tokens_per_item;
};

__device__ __forceinline__ int64_t cache_row(const KParams& p, int seq_base, int pos) {
  const int ps = p.a.page_size;
  const int pi = p.ps_shift >= 0 ? pos >> p.ps_shift : pos / ps;
  const int off = pos - pi * ps;
  return static_cast<int64_t>(p.a.page_indices[seq_base + pi]) * ps + off;
}

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

// cp.async of SZ bytes (4, 8 or 16); pred false writes zeros and reads nothing.
template <int SZ>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src = pred ? SZ : 0;
  if constexpr (SZ == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(SZ), "r"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <int DK, int DV>
struct Attn {
  static constexpr int RL = DK / 4;   // head-dim run per lane (K, Q)
  static constexpr int S = DK / 16;   // MMA k-steps of Q K^T
  static constexpr int VR = DV / 8;   // V run per lane = number of output n-tiles
  static constexpr bool kWideK = RL % 8 == 0;
  static_assert(DK % 16 == 0 && DV % 16 == 0, "head dims");

  // cp.async staging of one tile for one warp (decode pipeline). Every lane copies exactly the
  // bytes it will read back, in chunks interleaved across lanes (chunk c of lane l at
  // (c * 32 + l) * chunk): reads are conflict-free and no lane reads another's data, so the only
  // synchronisation needed is each thread's own cp.async wait.
  static constexpr int KBytes = DK / 2, VBytes = DV / 4;  // per lane per row
  static constexpr int KC = KBytes % 16 == 0 ? 16 : 8;
  static constexpr int VC = VBytes % 16 == 0 ? 16 : VBytes % 8 == 0 ? 8 : 4;
  static constexpr int NKC = KBytes / KC, NVC = VBytes / VC;
  static constexpr int kStageK = 2 * NKC * 32 * KC, kStageBytes = kStageK + 4 * NVC * 32 * VC;
  static constexpr int kStages = kStageBytes * kWarps * 3 <= 100 * 1024 ? 3 : 2;
  static constexpr int kPipeBytes = kStageBytes * kWarps * kStages;
  static constexpr int kMergeBytes = kWarps * 16 * (DV + 4) * 4 + 2 * kWarps * 16 * 4;
  static constexpr int kSmemBytes = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;

  static __device__ __forceinline__ void stage_issue(const KParams& p, int seq_base, int kvh, int p0, int kend, int g,
                                                     int t, int lane, unsigned char* st) {
    const int kw = p.a.kv_heads * DK, vw = p.a.kv_heads * DV;
    const bf16* kbase = p.a.k_cache + kvh * DK + t * RL;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = p0 + 8 * r + g;
      const bool ok = pos < kend;
      const unsigned char* src = reinterpret_cast<const unsigned char*>(kbase + (ok ? cache_row(p, seq_base, pos) : 0) * kw);
#pragma unroll
      for (int c = 0; c < NKC; ++c) cp_async<KC>(st + ((r * NKC + c) * 32 + lane) * KC, src + c * KC, ok);
    }
    const bf16* vbase = p.a.v_cache + kvh * DV + g * VR;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pos = p0 + (i >> 1) * 8 + 2 * t + (i & 1);
      const bool ok = pos < kend;
      const unsigned char* src = reinterpret_cast<const unsigned char*>(vbase + (ok ? cache_row(p, seq_base, pos) : 0) * vw);
#pragma unroll
      for (int c = 0; c < NVC; ++c) cp_async<VC>(st + kStageK + ((i * NVC + c) * 32 + lane) * VC, src + c * VC, ok);
    }
  }

  static __device__ __forceinline__ void stage_read(const unsigned char* st, int lane, uint2 (&k0)[S], uint2 (&k1)[S],
                                                    uint32_t (&vr)[4][VR / 2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      uint2* kr = r == 0 ? k0 : k1;
#pragma unroll
      for (int c = 0; c < NKC; ++c) {
        const unsigned char* a = st + ((r * NKC + c) * 32 + lane) * KC;
        if constexpr (KC == 16) {
          const uint4 v = *reinterpret_cast<const uint4*>(a);
          kr[2 * c] = make_uint2(v.x, v.y);
          kr[2 * c + 1] = make_uint2(v.z, v.w);
        } else {
          kr[c] = *reinterpret_cast<const uint2*>(a);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < NVC; ++c) {
        const unsigned char* a = st + kStageK + ((i * NVC + c) * 32 + lane) * VC;
        if constexpr (VC == 16) {
          const uint4 v = *reinterpret_cast<const uint4*>(a);
          vr[i][4 * c] = v.x, vr[i][4 * c + 1] = v.y, vr[i][4 * c + 2] = v.z, vr[i][4 * c + 3] = v.w;
        } else if constexpr (VC == 8) {
          const uint2 v = *reinterpret_cast<const uint2*>(a);
          vr[i][2 * c] = v.x, vr[i][2 * c + 1] = v.y;
        } else {
          vr[i][c] = *reinterpret_cast<const uint32_t*>(a);
        }
      }
  }

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
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = p0 + nt * 8 + 2 * t + (e & 1);
        const int lim = e < 2 ? lim0 : lim1;
        const float v = pos <= lim && pos < kend ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][e] = v;
        if (e < 2)
          mx0 = fmaxf(mx0, v);
        else
          mx1 = fmaxf(mx1, v);
      }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);
    // A row that has seen no key yet keeps max -inf; subtracting 0 then keeps every term 0.
    const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float al0 = exp2f(m[0] - b0), al1 = exp2f(m[1] - b1);
    m[0] = mn0;
    m[1] = mn1;
    float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - b0);
      s[nt][1] = exp2f(s[nt][1] - b0);
      s[nt][2] = exp2f(s[nt][2] - b1);
      s[nt][3] = exp2f(s[nt][3] - b1);
      ps0 += s[nt][0] + s[nt][1];
      ps1 += s[nt][2] + s[nt][3];
    }
    l[0] = l[0] * al0 + ps0;
    l[1] = l[1] * al1 + ps1;
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

// ---- decode: block = (token, kv head x head tile, split)
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) attn_decode_kernel(const __grid_constant__ KParams p) {
  using A = Attn<DK, DV>;
  extern __shared__ __align__(16) unsigned char s_dyn[];  // cp.async stages, then the warp merge
  // The kv heads of one token are neighbours in launch order (blockIdx.x): they read the
  // interleaved pieces of the same cache rows at about the same time.
  const int tok = blockIdx.y;
  const int kvh = blockIdx.x / p.head_tiles, ht = blockIdx.x % p.head_tiles;
  const int split = blockIdx.z;
  const int n = p.a.positions[tok] + 1;
  const int kbeg = split * p.chunk;
  if (kbeg >= n) return;  // this token needs fewer splits (the combine reads only those it needs)
  const int kend = min(n, kbeg + p.chunk);
  const int seq_base = p.a.page_indptr[p.a.token_seq[tok]];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Warp w takes the tiles kbeg + 16 w + 64 i; A::kStages - 1 of them are in flight ahead of the
  // one being multiplied.
  const int first = kbeg + warp * 16;
  const int ntiles = first < kend ? (kend - first + kWarps * 16 - 1) / (kWarps * 16) : 0;
  unsigned char* wbuf = s_dyn + warp * A::kStages * A::kStageBytes;
#pragma unroll
  for (int i = 0; i < A::kStages - 1; ++i) {
    if (i < ntiles) A::stage_issue(p, seq_base, kvh, first + i * kWarps * 16, kend, g, t, lane, wbuf + i * A::kStageBytes);
    cp_async_commit();
  }
  const int hr0 = ht * 16 + g, hr1 = hr0 + 8;
  const bool rv0 = hr0 < p.group, rv1 = hr1 < p.group;
  const bf16* qrow = p.a.q + static_cast<int64_t>(tok) * p.a.ld_q + static_cast<int64_t>(kvh) * p.group * DK;
  uint32_t qa[A::S][4];
  A::load_q(qrow + (rv0 ? hr0 : 0) * DK, rv0, qrow + (rv1 ? hr1 : 0) * DK, rv1, t, qa);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[A::VR][4];
#pragma unroll
  for (int j = 0; j < A::VR; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  for (int i = 0; i < ntiles; ++i) {
    const int ahead = i + A::kStages - 1;
    if (ahead < ntiles)
      A::stage_issue(p, seq_base, kvh, first + ahead * kWarps * 16, kend, g, t, lane,
                     wbuf + (ahead % A::kStages) * A::kStageBytes);
    cp_async_commit();
    cp_async_wait<A::kStages - 1>();  // tile i's group (and every older one) has landed
    uint2 k0[A::S], k1[A::S];
    uint32_t vr[4][A::VR / 2];
    A::stage_read(wbuf + (i % A::kStages) * A::kStageBytes, lane, k0, k1, vr);
    A::compute(p, first + i * kWarps * 16, kend, kend - 1, kend - 1, qa, k0, k1, vr, m, l, o, t);
  }
  cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncthreads();  // every warp is done with its stages: the buffer becomes the merge area
  float(*s_o)[16][DV + 4] = reinterpret_cast<float(*)[16][DV + 4]>(s_dyn);
  float(*s_m)[16] = reinterpret_cast<float(*)[16]>(s_dyn + kWarps * 16 * (DV + 4) * 4);
  float(*s_l)[16] = reinterpret_cast<float(*)[16]>(s_dyn + kWarps * 16 * (DV + 4) * 4 + kWarps * 16 * 4);
  if (t == 0) {
    s_m[warp][g] = m[0];
    s_m[warp][g + 8] = m[1];
    s_l[warp][g] = l[0];
    s_l[warp][g + 8] = l[1];
  }
#pragma unroll
  for (int j = 0; j < A::VR; ++j) {
    s_o[warp][g][2 * t * A::VR + j] = o[j][0];
    s_o[warp][g][(2 * t + 1) * A::VR + j] = o[j][1];
    s_o[warp][g + 8][2 * t * A::VR + j] = o[j][2];
    s_o[warp][g + 8][(2 * t + 1) * A::VR + j] = o[j][3];
  }
  __syncthreads();
  // Merge the warps (fixed order). Warp 0 always saw key kbeg, so M is finite.
  for (int idx = threadIdx.x; idx < 16 * DV; idx += kThreads) {
    const int row = idx / DV, col = idx % DV;
    const int hr = ht * 16 + row;
    if (hr >= p.group) continue;
    float M = s_m[0][row];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) M = fmaxf(M, s_m[w][row]);
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(s_m[w][row] - M);
      L += s_l[w][row] * f;
      O += s_o[w][row][col] * f;
    }
    const int h = kvh * p.group + hr;
    if (p.max_splits == 1) {
      p.a.out[static_cast<int64_t>(tok) * p.a.ld_out + static_cast<int64_t>(h) * DV + col] = __float2bfloat16(O / L);
    } else {
      float* w = p.ws + ((static_cast<int64_t>(tok) * p.a.heads + h) * p.max_splits + split) * (DV + 2);
      w[col] = O / L;
      if (col == 0) {
        w[DV] = M;
        w[DV + 1] = L;
      }
    }
  }
}

template <int DV>
__global__ void attn_combine_kernel(const __grid_constant__ KParams p) {
  const int tok = blockIdx.x / p.a.heads, h = blockIdx.x % p.a.heads;
  const int n = p.a.positions[tok] + 1;
  const int ns = (n + p.chunk - 1) / p.chunk;
  const float* base = p.ws + (static_cast<int64_t>(tok) * p.a.heads + h) * p.max_splits * (DV + 2);
  float M = -INFINITY;
  for (int s = 0; s < ns; ++s) M = fmaxf(M, base[s * (DV + 2) + DV]);
  float W = 0.0f;
  for (int s = 0; s < ns; ++s) W += base[s * (DV + 2) + DV + 1] * exp2f(base[s * (DV + 2) + DV] - M);
  for (int col = threadIdx.x; col < DV; col += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < ns; ++s) {
      const float* b = base + s * (DV + 2);
      acc += b[col] * b[DV + 1] * exp2f(b[DV] - M);
    }
    p.a.out[static_cast<int64_t>(tok) * p.a.ld_out + static_cast<int64_t>(h) * DV + col] = __float2bfloat16(acc / W);
  }
}

// ---- prefill: block = (item of consecutive tokens of one sequence, kv head, row chunk)
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) attn_prefill_kernel(const __grid_constant__ KParams p) {
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
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv0 = v0 ? 1.0f / l[0] : 0.0f, inv1 = v1 ? 1.0f / l[1] : 0.0f;
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
  k.head_tiles = (k.group + 15) / 16;
  k.chunk = plan.chunk;
  k.max_splits = plan.max_splits;
  k.ps_shift = (a.page_size & (a.page_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(a.page_size)) : -1;
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
    const dim3 grid(a.kv_heads * k.head_tiles, a.T, plan.max_splits);
    constexpr int smem = Attn<DK, DV>::kSmemBytes;
    attention_prepare();
    attn_decode_kernel<DK, DV><<<grid, kThreads, smem, stream>>>(k);
    MOELORA_CUDA_CHECK_LAUNCH();
    if (plan.max_splits > 1) {
      attn_combine_kernel<DV><<<a.T * a.heads, 128, 0, stream>>>(k);
      MOELORA_CUDA_CHECK_LAUNCH();
    }
  } else {
    if (plan.num_items == 0) return;
    const int zc = (plan.rows_per_item_tokens * k.group + kPrefillRows - 1) / kPrefillRows;
    const dim3 grid(plan.num_items, a.kv_heads, zc);
    attn_prefill_kernel<DK, DV><<<grid, kThreads, 0, stream>>>(k);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

template <int DK, int DV>
void raise_smem_limit() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Attn<DK, DV>::kSmemBytes));
}

void dispatch(const KParams& k, const AttentionPlan& plan, cudaStream_t stream) {
  const int dk = k.a.k_head_dim, dv = k.a.v_head_dim;
  if (dk == 32 && dv == 32) return launch_dims<32, 32>(k, plan, stream);
  if (dk == 48 && dv == 32) return launch_dims<48, 32>(k, plan, stream);
  if (dk == 48 && dv == 48) return launch_dims<48, 48>(k, plan, stream);
  if (dk == 64 && dv == 64) return launch_dims<64, 64>(k, plan, stream);
  if (dk == 128 && dv == 128) return launch_dims<128, 128>(k, plan, stream);
  if (dk == 192 && dv == 128) return launch_dims<192, 128>(k, plan, stream);
  MOELORA_CHECK_MSG(false, "attention: head dims k={} v={} not built", dk, dv);
}

void check_params(const AttentionParams& a) {
  MOELORA_CHECK_MSG(attention_head_dims_supported(a.k_head_dim, a.v_head_dim), "attention: head dims k={} v={}",
                    a.k_head_dim, a.v_head_dim);
  MOELORA_CHECK(a.kv_heads > 0 && a.heads % a.kv_heads == 0 && a.page_size > 0);
  auto al = [](const void* ptr, int bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; };
  // 8-byte runs of q and of the cache rows, 16-byte ones where the run allows (ld_q % 8 covers both).
  MOELORA_CHECK_MSG(a.ld_q % 8 == 0 && al(a.q, 16) && al(a.k_cache, 16) && al(a.v_cache, 16),
                    "attention: q rows and the caches must be 16-byte aligned");
}

}  // namespace

void attention_prepare() {
  static bool done = false;  // one engine thread launches (DESIGN); idempotent
  if (done) return;
  raise_smem_limit<32, 32>();
  raise_smem_limit<48, 32>();
  raise_smem_limit<48, 48>();
  raise_smem_limit<64, 64>();
  raise_smem_limit<128, 128>();
  raise_smem_limit<192, 128>();
  done = true;
}

bool attention_head_dims_supported(int k, int v) {
  return (k == 32 && v == 32) || (k == 48 && v == 32) || (k == 48 && v == 48) || (k == 64 && v == 64) ||
         (k == 128 && v == 128) || (k == 192 && v == 128);
}

AttentionPlan attention_plan(const int32_t* positions, const int32_t* token_seq, int T, int heads, int kv_heads,
                             const AttentionPlanOptions& opt) {
  AttentionPlan plan;
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
        cuda_plan::choose_attention_decode_split(T, kv_heads, group, maxn, opt.num_sms);
    plan.chunk = split.chunk;
    plan.max_splits = split.max_splits;
    return plan;
  }
  // Prefill: consecutive tokens of one sequence, up to 64 (token, head) rows per block.
  plan.rows_per_item_tokens = std::max(1, kPrefillRows / group);
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
  if (!plan.decode || plan.max_splits <= 1) return 0;
  return static_cast<size_t>(T) * heads * plan.max_splits * (v_head_dim + 2) * sizeof(float);
}

void launch_kv_cache_write(const AttentionParams& a, cudaStream_t stream) {
  if (a.T == 0) return;
  AttentionPlan none;
  const KParams k = make_params(a, none, nullptr, nullptr);
  kv_write_kernel<<<a.T, 128, 0, stream>>>(k);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_attention_no_cache_write(const AttentionParams& a, const AttentionPlan& plan, const void* dev_meta,
                                     void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (a.T == 0) return;
  check_params(a);
  MOELORA_CHECK_MSG(workspace_bytes >= attention_workspace_bytes(plan, a.T, a.heads, a.v_head_dim),
                    "attention: workspace {} B too small", workspace_bytes);
  MOELORA_CHECK(plan.decode || dev_meta != nullptr);
  dispatch(make_params(a, plan, dev_meta, workspace), plan, stream);
}

void launch_attention(const AttentionParams& a, const AttentionPlan& plan, const void* dev_meta, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  launch_kv_cache_write(a, stream);
  launch_attention_no_cache_write(a, plan, dev_meta, workspace, workspace_bytes, stream);
}

}  // namespace moelora::cuda
