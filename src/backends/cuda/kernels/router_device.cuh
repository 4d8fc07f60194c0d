// Device side of the router top-k: one warp routes one token. Shared by the standalone router
// kernel (router.cu) and the fused route+align kernel (moe_align.cu).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "backends/cuda/kernels/moe_common.cuh"
#include "backends/cuda/kernels/router.cuh"

namespace moelora::cuda::moe_detail {

// Expert e lives in lane e % 32, register e / 32. MAXV = ceil(E / 32) rounded up to a template
// size so every register array is indexed by compile-time constants (no local memory).

// (value, index) order of the reference: larger value first, equal values -> lower index.
template <typename T>
__device__ __forceinline__ bool better(T v, int i, T bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

template <typename T>
__device__ __forceinline__ void warp_argmax(T& bv, int& bi, double* carry = nullptr) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    double oc = 0.0;
    if (carry) oc = __shfl_xor_sync(0xffffffffu, *carry, o);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
      if (carry) *carry = oc;
    }
  }
}

// Softmax over the token's logits, top-k by logit (softmax is monotonic, so the order and the
// ties are those of the probabilities), weights = probabilities (renormalised over the k).
template <int MAXV>
__device__ void route_token_softmax(const RouterParams& p, int t) {
  const int lane = threadIdx.x & 31;
  const int E = p.E, k = p.k;
  const float* l = p.logits + static_cast<int64_t>(t) * E;
  float v[MAXV];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < E ? l[e] : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < MAXV; ++i)
    if (i * 32 + lane < E) sum += expf(v[i] - mx);
  sum = warp_sum(sum);

  uint32_t taken = 0;
  float top_sum = 0.0f, my_p = 0.0f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
      const int e = i * 32 + lane;
      if (e < E && !((taken >> i) & 1u) && better(v[i], e, bv, bi)) {
        bv = v[i];
        bi = e;
      }
    }
    warp_argmax(bv, bi);
    if (bi != INT_MAX && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    const float pj = expf(bv - mx) / sum;
    top_sum += pj;
    if (lane == j) {
      my_p = pj;
      my_id = bi;
    }
  }
  if (lane < k) {
    p.ids[static_cast<int64_t>(t) * k + lane] = my_id;
    p.weights[static_cast<int64_t>(t) * k + lane] = p.renormalize ? my_p / top_sum : my_p;
  }
}

// DeepSeek-V3 selection in f64 (as the reference): s = sigmoid(logit), choice = s + bias, group
// score = sum of the group's two best choices, keep the topk_group best groups, dropped groups'
// choices become 0.0 (transformers' masked_fill value, not -inf), top-k of the choices; weights
// are s of the chosen, / (sum + 1e-20) when renormalising, times `scaling`.
// `sc` is E doubles of shared memory private to this warp.
template <int MAXV>
__device__ void route_token_sigmoid_grouped(const RouterParams& p, int t, double* sc) {
  const int lane = threadIdx.x & 31;
  const int E = p.E, k = p.k;
  const float* l = p.logits + static_cast<int64_t>(t) * E;
  double s[MAXV], c[MAXV];
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int e = i * 32 + lane;
    if (e < E) {
      s[i] = 1.0 / (1.0 + exp(-static_cast<double>(l[e])));
      c[i] = s[i] + static_cast<double>(p.bias[e]);
      sc[e] = c[i];
    } else {
      s[i] = 0.0;
      c[i] = -INFINITY;
    }
  }
  __syncwarp();
  const int per_group = E / p.n_group;
  double gs = -INFINITY;
  if (lane < p.n_group) {
    double b1 = -INFINITY, b2 = -INFINITY;
    for (int q = 0; q < per_group; ++q) {
      const double x = sc[lane * per_group + q];
      if (x > b1) {
        b2 = b1;
        b1 = x;
      } else if (x > b2) {
        b2 = x;
      }
    }
    gs = per_group >= 2 ? b1 + b2 : b1;
  }
  __syncwarp();  // sc may be reused by this warp's next token
  uint32_t keep = 0;
  for (int j = 0; j < p.topk_group; ++j) {
    double bv = -INFINITY;
    int bi = INT_MAX;
    if (lane < p.n_group && !((keep >> lane) & 1u)) {
      bv = gs;
      bi = lane;
    }
    warp_argmax(bv, bi);
    if (bi != INT_MAX) keep |= 1u << bi;
  }
#pragma unroll
  for (int i = 0; i < MAXV; ++i) {
    const int e = i * 32 + lane;
    if (e < E && !((keep >> (e / per_group)) & 1u)) c[i] = 0.0;
  }
  uint32_t taken = 0;
  double top_sum = 0.0, my_s = 0.0;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    double bv = -INFINITY, bs = 0.0;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < MAXV; ++i) {
      const int e = i * 32 + lane;
      if (e < E && !((taken >> i) & 1u) && better(c[i], e, bv, bi)) {
        bv = c[i];
        bi = e;
        bs = s[i];
      }
    }
    warp_argmax(bv, bi, &bs);
    if (bi != INT_MAX && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    top_sum += bs;
    if (lane == j) {
      my_s = bs;
      my_id = bi;
    }
  }
  if (lane < k) {
    double w = my_s;
    if (p.renormalize) w /= (top_sum + 1e-20);
    p.ids[static_cast<int64_t>(t) * k + lane] = my_id;
    p.weights[static_cast<int64_t>(t) * k + lane] = static_cast<float>(w * static_cast<double>(p.scaling));
  }
}

template <int MAXV>
__device__ __forceinline__ void route_token(const RouterParams& p, int t, double* sc) {
  if (p.mode == RouterMode::kSoftmax)
    route_token_softmax<MAXV>(p, t);
  else
    route_token_sigmoid_grouped<MAXV>(p, t, sc);
}

// Routes tokens warp-strided over the block (each warp its own E-double scratch at sc + warp*E).
// MAX_E bounds the register arrays compiled in (a 1024-thread block has 64 registers a thread).
template <int MAX_E = 1024>
__device__ __forceinline__ void route_tokens_block(const RouterParams& p, int first, int stride, double* sc) {
  const int warp = threadIdx.x >> 5;
  double* my = sc + static_cast<int64_t>(warp) * p.E;
  for (int t = first + warp; t < p.T; t += stride) {
    if (p.E <= 128)
      route_token<4>(p, t, my);
    else if (MAX_E > 128 && p.E <= 256)
      route_token<(MAX_E > 128 ? 8 : 4)>(p, t, my);
    else if (MAX_E > 256 && p.E <= 512)
      route_token<(MAX_E > 256 ? 16 : 4)>(p, t, my);
    else if (MAX_E > 512)
      route_token<(MAX_E > 512 ? 32 : 4)>(p, t, my);
  }
}

}  // namespace moelora::cuda::moe_detail
