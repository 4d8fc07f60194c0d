// Elementwise kernels (see elementwise.cuh). All memory-bound and small: the aim is one pass, wide
// loads where the row layout allows them, f32 arithmetic and a single rounding to bf16.
#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/elementwise.cuh"

namespace moelora::cuda {
namespace {

constexpr int kThreads = 256;

// 16-byte vectors are usable when every row start and the width are 8-element aligned.
bool vec8_ok(const void* a, int64_t lda, const void* b, int64_t ldb, int cols) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return cols % 8 == 0 && lda % 8 == 0 && ldb % 8 == 0 && aligned(a) && aligned(b);
}

int grid_for(int64_t work, int threads) {
  return static_cast<int>(std::min<int64_t>(ceil_div64(work, threads), 65535 * 8));
}

// ---- embedding
__global__ void embed_kernel(EmbedParams p, bool vec) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int t = blockIdx.x;
  const int id = p.ids[t];
  const bool ok = id >= 0 && id < p.vocab;
  const bf16* src = p.table + static_cast<int64_t>(ok ? id : 0) * p.hidden;
  bf16* dst = p.out + t * p.ld_out;
  if (vec) {
    for (int c = threadIdx.x * 8; c < p.hidden; c += blockDim.x * 8) {
      uint4 v = ok ? ldg_u4(src + c) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(dst + c) = v;
    }
  } else {
    for (int c = threadIdx.x; c < p.hidden; c += blockDim.x) dst[c] = ok ? src[c] : __float2bfloat16(0.0f);
  }
}

// ---- RMSNorm. Small groups (<= 256, per-head norms): one warp per group, values kept in registers.
// Large groups (hidden): one block per group, two passes (the second pass hits L1).
constexpr int kSmallGroupMax = 256;

__global__ void rmsnorm_warp_kernel(RmsNormParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int groups_per_row = p.cols / p.group;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (gid >= static_cast<int64_t>(p.T) * groups_per_row) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = gid / groups_per_row;
  const int g0 = static_cast<int>(gid % groups_per_row) * p.group;
  const bf16* x = p.x + t * p.ld_x + g0;
  float v[kSmallGroupMax / 32];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kSmallGroupMax / 32; ++j) {
    const int c = lane + 32 * j;
    v[j] = c < p.group ? __bfloat162float(x[c]) : 0.0f;
    if (p.add && c < p.group) {  // the residual add's rounded sum, as add_kernel makes it
      const bf16 s = __float2bfloat16(__bfloat162float(p.add[t * p.ld_add + g0 + c]) + v[j]);
      p.sum[t * p.ld_sum + g0 + c] = s;
      v[j] = __bfloat162float(s);
    }
    ss += v[j] * v[j];
  }
  ss = warp_sum(ss);
  // Explicit roundings (no contraction into an FMA): head_norm_rope_kernel computes the same bits.
  const float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.group)), p.eps));
  bf16* y = p.out + t * p.ld_out + g0;
#pragma unroll
  for (int j = 0; j < kSmallGroupMax / 32; ++j) {
    const int c = lane + 32 * j;
    if (c < p.group) y[c] = __float2bfloat16(v[j] * inv * __bfloat162float(p.w[c]));
  }
}

__global__ void rmsnorm_block_kernel(RmsNormParams p, bool vec) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int groups_per_row = p.cols / p.group;
  const int64_t t = blockIdx.x / groups_per_row;
  const int g0 = static_cast<int>(blockIdx.x % groups_per_row) * p.group;
  const bf16* x = p.x + t * p.ld_x + g0;
  bf16* y = p.out + t * p.ld_out + g0;
  // With a residual add: the rounded sum is written to `sum` and both passes read it (each element
  // by the thread that wrote it), so the norm is that of the stored sum.
  const bf16* a = p.add ? p.add + t * p.ld_add + g0 : nullptr;
  bf16* s = p.add ? p.sum + t * p.ld_sum + g0 : nullptr;
  float ss = 0.0f;
  if (vec) {
    for (int c = threadIdx.x * 8; c < p.group; c += blockDim.x * 8) {
      uint4 v = ldg_u4(x + c);
      if (a) {
        const uint4 r = ldg_u4(a + c);
        v.x = pack_bf16x2(u4_bf16(r, 0) + u4_bf16(v, 0), u4_bf16(r, 1) + u4_bf16(v, 1));
        v.y = pack_bf16x2(u4_bf16(r, 2) + u4_bf16(v, 2), u4_bf16(r, 3) + u4_bf16(v, 3));
        v.z = pack_bf16x2(u4_bf16(r, 4) + u4_bf16(v, 4), u4_bf16(r, 5) + u4_bf16(v, 5));
        v.w = pack_bf16x2(u4_bf16(r, 6) + u4_bf16(v, 6), u4_bf16(r, 7) + u4_bf16(v, 7));
        *reinterpret_cast<uint4*>(s + c) = v;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += u4_bf16(v, i) * u4_bf16(v, i);
    }
  } else {
    for (int c = threadIdx.x; c < p.group; c += blockDim.x) {
      float f = __bfloat162float(x[c]);
      if (a) {
        const bf16 r = __float2bfloat16(__bfloat162float(a[c]) + f);
        s[c] = r;
        f = __bfloat162float(r);
      }
      ss += f * f;
    }
  }
  if (a) x = s;  // the second pass normalises the stored sum
  __shared__ float red[32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float r = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
    r = warp_sum(r);
    if (threadIdx.x == 0) red[0] = r;
  }
  __syncthreads();
  const float inv = 1.0f / sqrtf(red[0] / p.group + p.eps);
  // x and y may alias: every element is read by the thread that writes it, after the reduction.
  if (vec) {
    for (int c = threadIdx.x * 8; c < p.group; c += blockDim.x * 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + c);
      const uint4 w = ldg_u4(p.w + c);
      uint4 o;
      o.x = pack_bf16x2(u4_bf16(v, 0) * inv * u4_bf16(w, 0), u4_bf16(v, 1) * inv * u4_bf16(w, 1));
      o.y = pack_bf16x2(u4_bf16(v, 2) * inv * u4_bf16(w, 2), u4_bf16(v, 3) * inv * u4_bf16(w, 3));
      o.z = pack_bf16x2(u4_bf16(v, 4) * inv * u4_bf16(w, 4), u4_bf16(v, 5) * inv * u4_bf16(w, 5));
      o.w = pack_bf16x2(u4_bf16(v, 6) * inv * u4_bf16(w, 6), u4_bf16(v, 7) * inv * u4_bf16(w, 7));
      *reinterpret_cast<uint4*>(y + c) = o;
    }
  } else {
    for (int c = threadIdx.x; c < p.group; c += blockDim.x)
      y[c] = __float2bfloat16(__bfloat162float(x[c]) * inv * __bfloat162float(p.w[c]));
  }
}

// ---- RoPE: one thread per (token, pair); cos/sin computed once and applied to every head.
// The rotation of one pair, with explicit roundings (no contraction left to the compiler), so that
// rope_kernel and head_norm_rope_kernel give the same bits.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float s, bf16* o1, bf16* o2) {
  *o1 = __float2bfloat16(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
  *o2 = __float2bfloat16(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}
// cos and sin of pair i at position pos, times the attention factor (as transformers: f32 angle).
__device__ __forceinline__ void rope_cos_sin(int32_t pos, float inv_freq, float factor, float* c, float* s) {
  // Same f32 product as transformers; sincosf is the accurate (non-intrinsic) version.
  const float angle = static_cast<float>(pos) * inv_freq;
  sincosf(angle, s, c);
  *c *= factor;
  *s *= factor;
}

// Element offset of token t's row, kv head kvh, in a cache of kv_heads heads of D values.
__device__ __forceinline__ int64_t kv_cache_offset(const KvCacheWrite& c, int64_t t, int32_t pos, int kv_heads, int D,
                                                   int kvh) {
  const int64_t row = paged_cache_row(c.page_indices + c.page_indptr[c.token_seq[t]], c.page_size, pos);
  return row * (static_cast<int64_t>(kv_heads) * D) + static_cast<int64_t>(kvh) * D;
}

// Heads per thread: a thread rotates one pair of up to kRopeHeadsPerThread heads (grid.y spreads
// the rest), loading all of them before it stores any. One thread walking every head with a load
// after each store (the stores may alias later loads as far as the compiler knows) was a chain of
// dependent global round trips: 15 us for DeepSeek-V3's 128 query heads at one token on the H200
// (ncu, 2026-12-07); this form: 11.8 us for both rotations of a DeepSeek-V3 layer at one token
// (ncu, H100, 2026-12-07, bench/RESULTS.md), 61 us before (H200).
constexpr int kRopeHeadsPerThread = 8;

__global__ void rope_kernel(RopeParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int half = p.rot_dim / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.T) * half) return;
  const int64_t t = idx / half;
  const int i = static_cast<int>(idx % half);
  const int h0 = static_cast<int>(blockIdx.y) * kRopeHeadsPerThread;
  const int nh = min(kRopeHeadsPerThread, p.heads - h0);
  float s, c;
  const int32_t pos = p.positions[t];
  rope_cos_sin(pos, p.inv_freq[i], p.attention_factor, &c, &s);
  const int o1 = p.interleaved ? 2 * i : i;
  const int o2 = p.interleaved ? 2 * i + 1 : i + half;
  bf16* row = p.x + t * p.ld_x + p.rot_offset;
  float x1[kRopeHeadsPerThread], x2[kRopeHeadsPerThread];
#pragma unroll
  for (int j = 0; j < kRopeHeadsPerThread; ++j) {
    if (j >= nh) break;
    const bf16* base = row + static_cast<int64_t>(h0 + j) * p.head_stride;
    x1[j] = __bfloat162float(base[o1]);
    x2[j] = __bfloat162float(base[o2]);
  }
  const KvCacheWrite& kw = p.cache;
  const int kv_heads = p.heads - p.kv_first_head;
  const int64_t cache_row = kw.k_cache ? kv_cache_offset(kw, t, pos, kv_heads, p.head_stride, 0) : 0;
#pragma unroll
  for (int j = 0; j < kRopeHeadsPerThread; ++j) {
    if (j >= nh) break;
    const int h = h0 + j;
    bf16* base = row + static_cast<int64_t>(h) * p.head_stride;
    bf16 r1, r2;
    rope_pair(x1[j], x2[j], c, s, &r1, &r2);
    base[o1] = r1;
    base[o2] = r2;
    if (kw.k_cache && h >= p.kv_first_head) {  // pair (o1, o2) of a kv head: its rotated k and its v
      const int64_t off = cache_row + static_cast<int64_t>(h - p.kv_first_head) * p.head_stride;
      kw.k_cache[off + o1] = r1;
      kw.k_cache[off + o2] = r2;
      const bf16* vs = kw.v + t * kw.ld_v + static_cast<int64_t>(h - p.kv_first_head) * p.head_stride;
      kw.v_cache[off + o1] = vs[o1];
      kw.v_cache[off + o2] = vs[o2];
    }
  }
}

// ---- Per-head RMSNorm then RoPE: one warp per (token, head); lane l holds elements l + 32 j.
// The norm is rmsnorm_warp_kernel's (same sums in the same order, same bf16 rounding of the
// output); the neox partner of element l + 32 j (< head_dim / 2) is l + 32 (j + head_dim / 64),
// in the same lane, so the rotation needs no exchange.
constexpr int kHeadNormRopeMaxDim = 256;

template <int D>  // head_dim: every register index a compile-time constant
__global__ void head_norm_rope_kernel(HeadNormRopeParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  static_assert(D % 64 == 0 && D <= kHeadNormRopeMaxDim, "head_dim");
  constexpr int kHalf = D / 2, kJn = D / 32, kJh = kHalf / 32;
  const int heads = p.q_heads + p.kv_heads;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (gid >= static_cast<int64_t>(p.T) * heads) return;
  const int lane = threadIdx.x & 31;
  const int64_t t = gid / heads;
  const int h = static_cast<int>(gid % heads);
  bf16* x = p.x + t * p.ld_x + static_cast<int64_t>(h) * D;
  const bf16* w = h < p.q_heads ? p.q_norm : p.k_norm;
  // The sums in rmsnorm_warp_kernel's order (its unused slots add +0 to a sum of squares, which
  // changes nothing, so they are left out here).
  float v[kJn];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kJn; ++j) {
    v[j] = __bfloat162float(x[lane + 32 * j]);
    ss += v[j] * v[j];
  }
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), p.eps));
#pragma unroll
  for (int j = 0; j < kJn; ++j)  // the normed head as rmsnorm stores it
    v[j] = __bfloat162float(__float2bfloat16(v[j] * inv * __bfloat162float(w[lane + 32 * j])));
  const int32_t pos = p.positions[t];
  // A kv head with the cache write: its row of the cache (the page table as attention.cu reads it).
  const KvCacheWrite& kw = p.cache;
  const bool to_cache = kw.k_cache != nullptr && h >= p.q_heads;
  bf16* kc = nullptr;
  if (to_cache) {
    const int64_t off = kv_cache_offset(kw, t, pos, p.kv_heads, D, h - p.q_heads);
    kc = kw.k_cache + off;
    const bf16* vs = kw.v + t * kw.ld_v + static_cast<int64_t>(h - p.q_heads) * D;
    bf16* vd = kw.v_cache + off;
#pragma unroll
    for (int j = 0; j < kJn; ++j) vd[lane + 32 * j] = vs[lane + 32 * j];
  }
#pragma unroll
  for (int j = 0; j < kJh; ++j) {
    const int i = lane + 32 * j;
    float c, s;
    rope_cos_sin(pos, p.inv_freq[i], p.attention_factor, &c, &s);
    rope_pair(v[j], v[j + kJh], c, s, x + i, x + i + kHalf);
    if (to_cache) {  // the stored bits, read back by the thread that wrote them
      kc[i] = x[i];
      kc[i + kHalf] = x[i + kHalf];
    }
  }
}

// ---- SiLU·mul, add, conversions: grid-stride over elements, 8 at a time when aligned.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__global__ void silu_mul_kernel(SiluMulParams p, bool vec) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int step = vec ? 8 : 1;
  const int per_row = ceil_div(p.cols, step);
  const int64_t n = static_cast<int64_t>(p.T) * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row;
    const int c = static_cast<int>(i % per_row) * step;
    const bf16* g = p.gate + t * p.ld_gate + c;
    const bf16* u = p.up + t * p.ld_up + c;
    bf16* o = p.out + t * p.ld_out + c;
    if (vec) {
      const uint4 gv = ldg_u4(g), uv = ldg_u4(u);
      uint4 r;
      r.x = pack_bf16x2(silu(u4_bf16(gv, 0)) * u4_bf16(uv, 0), silu(u4_bf16(gv, 1)) * u4_bf16(uv, 1));
      r.y = pack_bf16x2(silu(u4_bf16(gv, 2)) * u4_bf16(uv, 2), silu(u4_bf16(gv, 3)) * u4_bf16(uv, 3));
      r.z = pack_bf16x2(silu(u4_bf16(gv, 4)) * u4_bf16(uv, 4), silu(u4_bf16(gv, 5)) * u4_bf16(uv, 5));
      r.w = pack_bf16x2(silu(u4_bf16(gv, 6)) * u4_bf16(uv, 6), silu(u4_bf16(gv, 7)) * u4_bf16(uv, 7));
      *reinterpret_cast<uint4*>(o) = r;
    } else {
      *o = __float2bfloat16(silu(__bfloat162float(*g)) * __bfloat162float(*u));
    }
  }
}

__global__ void add_kernel(AddParams p, bool vec) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int step = vec ? 8 : 1;
  const int per_row = ceil_div(p.cols, step);
  const int64_t n = static_cast<int64_t>(p.T) * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row;
    const int c = static_cast<int>(i % per_row) * step;
    const bf16* x = p.x + t * p.ld_x + c;
    bf16* io = p.inout + t * p.ld_inout + c;
    if (vec) {
      const uint4 a = ldg_u4(x);
      const uint4 b = *reinterpret_cast<const uint4*>(io);
      uint4 r;
      r.x = pack_bf16x2(u4_bf16(a, 0) + u4_bf16(b, 0), u4_bf16(a, 1) + u4_bf16(b, 1));
      r.y = pack_bf16x2(u4_bf16(a, 2) + u4_bf16(b, 2), u4_bf16(a, 3) + u4_bf16(b, 3));
      r.z = pack_bf16x2(u4_bf16(a, 4) + u4_bf16(b, 4), u4_bf16(a, 5) + u4_bf16(b, 5));
      r.w = pack_bf16x2(u4_bf16(a, 6) + u4_bf16(b, 6), u4_bf16(a, 7) + u4_bf16(b, 7));
      *reinterpret_cast<uint4*>(io) = r;
    } else {
      *io = __float2bfloat16(__bfloat162float(*x) + __bfloat162float(*io));
    }
  }
}

template <typename In, typename Out>
__global__ void convert_kernel(ConvertParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int64_t n = static_cast<int64_t>(p.T) * p.cols;
  const In* in = static_cast<const In*>(p.in);
  Out* out = static_cast<Out*>(p.out);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / p.cols;
    const int c = static_cast<int>(i % p.cols);
    const In v = in[t * p.ld_in + c];
    if constexpr (sizeof(Out) == 4)
      out[t * p.ld_out + c] = __bfloat162float(v);
    else
      out[t * p.ld_out + c] = __float2bfloat16(v);
  }
}

// ---- Row gather: one block per output row, byte copy in the widest unit the layout allows.
template <typename Unit>
__global__ void gather_rows_kernel(GatherRowsParams p, int units_per_row, int64_t ld_x_units,
                                   int64_t ld_out_units) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int r = blockIdx.x;
  const Unit* src = static_cast<const Unit*>(p.x) + static_cast<int64_t>(p.rows[r]) * ld_x_units;
  Unit* dst = static_cast<Unit*>(p.out) + r * ld_out_units;
  for (int c = threadIdx.x; c < units_per_row; c += blockDim.x) dst[c] = src[c];
}

// ---- MLA k/v split: one block per token.
__global__ void mla_split_kv_kernel(MlaSplitKvParams p) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int64_t t = blockIdx.x;
  const bf16* src = p.kv + t * p.ld_kv;
  const bf16* pe = p.k_pe + t * p.ld_k_pe;
  bf16* k = p.k + t * p.ld_k;
  bf16* v = p.v + t * p.ld_v;
  const int kw = p.nope + p.rope, sw = p.nope + p.v_dim;
  for (int i = threadIdx.x; i < p.heads * kw; i += blockDim.x) {
    const int h = i / kw, d = i % kw;
    k[i] = d < p.nope ? src[h * sw + d] : pe[d - p.nope];
  }
  for (int i = threadIdx.x; i < p.heads * p.v_dim; i += blockDim.x) {
    const int h = i / p.v_dim, d = i % p.v_dim;
    v[i] = src[h * sw + p.nope + d];
  }
}

}  // namespace

void launch_embed(const EmbedParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  const bool vec = vec8_ok(p.table, p.hidden, p.out, p.ld_out, p.hidden);
  launch_pdl(embed_kernel, dim3(p.T), dim3(128), 0, stream, p, vec);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.group > 0 && p.cols % p.group == 0);
  MOELORA_CHECK_MSG(!p.add || (p.sum == p.x && p.ld_sum == p.ld_x), "rmsnorm: a residual add writes its sum to x");
  if (p.T == 0) return;
  const int64_t groups = static_cast<int64_t>(p.T) * (p.cols / p.group);
  if (p.group <= kSmallGroupMax) {
    const int warps = 4;
    launch_pdl(rmsnorm_warp_kernel, dim3(static_cast<unsigned>(ceil_div64(groups, warps))), dim3(warps * 32), 0, stream, p);
  } else {
    const bool vec = vec8_ok(p.x, p.ld_x, p.out, p.ld_out, p.group) && p.group % 8 == 0 &&
                     (reinterpret_cast<uintptr_t>(p.w) & 15u) == 0;
    if (vec && p.add && !vec8_ok(p.add, p.ld_add, p.sum, p.ld_sum, p.group)) {
      // The fused kernel would sum the squares in the scalar order where the plain norm uses the
      // vector one: the two launches instead, so the result stays that of add then rmsnorm.
      launch_add(AddParams{p.add, p.ld_add, p.sum, p.ld_sum, p.T, p.cols}, stream);
      RmsNormParams q = p;
      q.add = nullptr;
      q.sum = nullptr;
      launch_pdl(rmsnorm_block_kernel, dim3(static_cast<unsigned>(groups)), dim3(kThreads), 0, stream, q, true);
      MOELORA_CUDA_CHECK_LAUNCH();
      return;
    }
    launch_pdl(rmsnorm_block_kernel, dim3(static_cast<unsigned>(groups)), dim3(kThreads), 0, stream, p, vec);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

static void check_cache_write(const KvCacheWrite& c, const char* op) {
  MOELORA_CHECK_MSG(!c.k_cache || (c.v_cache && c.v && c.page_size > 0 && c.token_seq && c.page_indptr && c.page_indices),
                    "{}: a cache write needs v, both caches and the page tables", op);
}

void launch_rope(const RopeParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.rot_dim % 2 == 0 && p.rot_offset + p.rot_dim <= p.head_stride);
  check_cache_write(p.cache, "rope");
  MOELORA_CHECK_MSG(!p.cache.k_cache || (p.rot_offset == 0 && p.rot_dim == p.head_stride && p.kv_first_head > 0 &&
                                         p.kv_first_head < p.heads),
                    "rope: the cache write needs whole heads rotated and kv heads after the q heads");
  if (p.T == 0 || p.rot_dim == 0 || p.heads <= 0) return;
  const int64_t n = static_cast<int64_t>(p.T) * (p.rot_dim / 2);
  const dim3 grid(static_cast<unsigned>(ceil_div64(n, 128)), static_cast<unsigned>(ceil_div(p.heads, kRopeHeadsPerThread)));
  launch_pdl(rope_kernel, grid, dim3(128), 0, stream, p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

bool head_norm_rope_supported(int head_dim, int rot_dim, bool interleaved) {
  return !interleaved && rot_dim == head_dim && head_dim % 64 == 0 && head_dim <= kHeadNormRopeMaxDim;
}

void launch_head_norm_rope(const HeadNormRopeParams& p, cudaStream_t stream) {
  MOELORA_CHECK_MSG(head_norm_rope_supported(p.head_dim, p.head_dim, false) && p.q_norm && p.k_norm,
                    "head_norm_rope: head_dim {} (a multiple of 64 up to {})", p.head_dim, kHeadNormRopeMaxDim);
  check_cache_write(p.cache, "head_norm_rope");
  if (p.T == 0) return;
  const int64_t warps = static_cast<int64_t>(p.T) * (p.q_heads + p.kv_heads);
  const dim3 grid(static_cast<unsigned>(ceil_div64(warps, 4))), block(128);
  switch (p.head_dim) {
    case 64: launch_pdl(head_norm_rope_kernel<64>, grid, block, 0, stream, p); break;
    case 128: launch_pdl(head_norm_rope_kernel<128>, grid, block, 0, stream, p); break;
    case 192: launch_pdl(head_norm_rope_kernel<192>, grid, block, 0, stream, p); break;
    default: launch_pdl(head_norm_rope_kernel<256>, grid, block, 0, stream, p); break;
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_silu_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.cols == 0) return;
  const bool vec = vec8_ok(p.gate, p.ld_gate, p.up, p.ld_up, p.cols) && vec8_ok(p.out, p.ld_out, p.out, p.ld_out, p.cols);
  const int64_t n = static_cast<int64_t>(p.T) * ceil_div(p.cols, vec ? 8 : 1);
  launch_pdl(silu_mul_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), 0, stream, p, vec);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_add(const AddParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.cols == 0) return;
  const bool vec = vec8_ok(p.x, p.ld_x, p.inout, p.ld_inout, p.cols);
  const int64_t n = static_cast<int64_t>(p.T) * ceil_div(p.cols, vec ? 8 : 1);
  launch_pdl(add_kernel, dim3(grid_for(n, kThreads)), dim3(kThreads), 0, stream, p, vec);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_gather_rows(const GatherRowsParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.elem_bytes == 2 || p.elem_bytes == 4);
  if (p.R == 0 || p.cols == 0) return;
  const int64_t row_bytes = static_cast<int64_t>(p.cols) * p.elem_bytes;
  const int64_t ldx_b = p.ld_x * p.elem_bytes, ldo_b = p.ld_out * p.elem_bytes;
  const bool v16 = row_bytes % 16 == 0 && ldx_b % 16 == 0 && ldo_b % 16 == 0 &&
                   (reinterpret_cast<uintptr_t>(p.x) & 15u) == 0 && (reinterpret_cast<uintptr_t>(p.out) & 15u) == 0;
  if (v16) {
    launch_pdl(gather_rows_kernel<uint4>, dim3(p.R), dim3(128), 0, stream, p, static_cast<int>(row_bytes / 16), ldx_b / 16, ldo_b / 16);
  } else if (p.elem_bytes == 4) {
    launch_pdl(gather_rows_kernel<uint32_t>, dim3(p.R), dim3(128), 0, stream, p, p.cols, p.ld_x, p.ld_out);
  } else {
    launch_pdl(gather_rows_kernel<uint16_t>, dim3(p.R), dim3(128), 0, stream, p, p.cols, p.ld_x, p.ld_out);
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_mla_split_kv(const MlaSplitKvParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  launch_pdl(mla_split_kv_kernel, dim3(p.T), dim3(128), 0, stream, p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_bf16_to_f32(const ConvertParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.cols == 0) return;
  launch_pdl(convert_kernel<bf16, float>, dim3(grid_for(static_cast<int64_t>(p.T) * p.cols, kThreads)), dim3(kThreads), 0, stream, p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_f32_to_bf16(const ConvertParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.cols == 0) return;
  launch_pdl(convert_kernel<float, bf16>, dim3(grid_for(static_cast<int64_t>(p.T) * p.cols, kThreads)), dim3(kThreads), 0, stream, p);
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
