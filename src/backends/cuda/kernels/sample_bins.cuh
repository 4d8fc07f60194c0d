// The sampler's binned selection (sample_kernel.cu): a row's tokens in kBins bins by their distance
// below the row's largest finite value, counts and exact fixed-point masses per bin, the walk that
// finds the bin where a cumulative count or mass reaches a target, and the exact resolution of that
// bin by sorting its tokens in shared memory. Device code for sample_kernel.cu.
//
// Why bins by distance and not by the bits of the order key: the key's top bits are the float's
// exponent, so a row of logits between 8 and 16 lands in one 8-bit digit and a radix selection needs
// four passes over the row, each recomputing the masses. A bin of the distance (top - v) * scale is
// as fine where the tokens are as the row's spread allows (the bins span the row's finite range, at
// most the 24 T below the top beyond which no token has mass), so one histogram pass usually leaves
// a few hundred tokens in the bin that holds a boundary, which one more pass collects.
//
// Exactness: bin(v) is non-increasing in v (IEEE subtraction and multiplication are monotone, floor
// too), so the bins are contiguous runs of the order and the cumulative sums over whole bins are the
// reference's prefix sums; inside a bin the tokens are sorted by (order key, id) and summed exactly.
#pragma once

#include "backends/cuda/kernels/sample_internal.cuh"

namespace moelora::cuda::sample_detail {

// Where a token falls: bin 0 holds +inf (first in the order) and the top; bin kBins - 1 holds
// everything at or beyond the span, and -inf and NaN (last in the order).
struct BinMap {
  float top;    // the row's largest finite (processed) value
  float scale;  // bins per unit below `top`
  __device__ float distance(float v) const { return __fmul_rn(__fsub_rn(top, v), scale); }
  __device__ uint32_t bin(float v) const {
    if (v == INFINITY) return 0;
    if (!(v > -INFINITY)) return kBins - 1;
    const float d = distance(v);
    return d < static_cast<float>(kBins - 1) ? static_cast<uint32_t>(d) : kBins - 1;
  }
  // The sub-bin of a token of bin b < kBins - 1: the same split of [b, b + 1) into kBins (d - b is
  // exact for d in [b, b + 1), and the multiply by a power of two too, so this is monotone as well).
  __device__ uint32_t sub_bin(float v, uint32_t b) const {
    if (v == INFINITY) return 0;
    const float f = __fmul_rn(__fsub_rn(distance(v), static_cast<float>(b)), static_cast<float>(kBins));
    return f < static_cast<float>(kBins - 1) ? static_cast<uint32_t>(f) : kBins - 1;
  }
};

// Tokens more than 24 T below the top have no mass (exp(-24) * 2^32 < 1/2), so the bins span at
// most that; a row whose finite values are closer together gets finer bins.
__device__ inline BinMap make_bin_map(float top, float bottom, float temperature) {
  const float range = fminf(__fsub_rn(top, bottom), __fmul_rn(24.0f, temperature));
  float scale = __fdiv_rn(static_cast<float>(kBins - 1), range);
  if (!(scale > 0.0f && scale < INFINITY)) scale = 1.0f;  // one finite value, or an overflowing span
  return BinMap{top, scale};
}

// mass_q32, without the double exp where the mass certainly rounds to 0: (top - v) / T > 23.5 in
// float (within ~1e-6 relative of the double argument) means exp(..) * 2^32 < 0.3.
__device__ inline unsigned long long token_mass(float v, float top, double inv_t, float inv_t_f) {
  if (v > -INFINITY && v < INFINITY && __fmul_rn(__fsub_rn(top, v), inv_t_f) > 23.5f) return 0;
  return sampling::mass_q32(v, top, inv_t);
}

// Adds (1, q) of every active lane to bin `bin` of (cnt, mass), this block's shared memory: one
// atomic per lane, or one for the warp when all its active lanes share the bin (tied logits).
// (Also summing the lanes of the last bin, where most of a peaked row's tokens fall, in one atomic
// was measured slower on the H200: 256 rows 569 -> 687 us, bench/RESULTS.md 2026-12-06 run 3.)
__device__ inline void bin_add(uint32_t* cnt, unsigned long long* mass, bool active, uint32_t bin,
                               unsigned long long q) {
  const unsigned act = __ballot_sync(kFull, active);
  if (!act) return;
  const int lead = __ffs(act) - 1;
  const uint32_t b0 = __shfl_sync(kFull, bin, lead);
  if (__all_sync(kFull, !active || bin == b0)) {
    // q <= 2^32: split so that 32-lane sums fit in 32 bits.
    const unsigned ls = __reduce_add_sync(kFull, active ? static_cast<unsigned>(q & 0xFFFFu) : 0u);
    const unsigned hs = __reduce_add_sync(kFull, active ? static_cast<unsigned>(q >> 16) : 0u);
    if ((threadIdx.x & 31) == lead) {
      atomicAdd(&cnt[b0], static_cast<uint32_t>(__popc(act)));
      const unsigned long long s = (static_cast<unsigned long long>(hs) << 16) + ls;
      if (s) shared_add_u64(&mass[b0], s);
    }
    return;
  }
  if (active) {
    atomicAdd(&cnt[bin], 1u);
    if (q) shared_add_u64(&mass[bin], q);
  }
}

// This block's histogram added into another's (the leader's), bin by bin.
__device__ inline void merge_bins(const Smem& sm, uint32_t* cnt, unsigned long long* mass) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    if (sm.cnt[b]) atomicAdd(&cnt[b], sm.cnt[b]);
    if (sm.mass[b]) atomicAdd(&mass[b], sm.mass[b]);
  }
}

__device__ inline void clear_bins(uint32_t* cnt, unsigned long long* mass) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) cnt[b] = 0, mass[b] = 0;
}

// Exclusive prefix sums of (a, b) over the block's threads in thread order (all threads call it).
__device__ inline void block_exclusive_scan2(unsigned long long& a, unsigned long long& b, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long ia = a, ib = b;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long ta = __shfl_up_sync(kFull, ia, o), tb = __shfl_up_sync(kFull, ib, o);
    if (lane >= o) ia += ta, ib += tb;
  }
  __syncthreads();  // an earlier scan has read the partials
  if (lane == 31) sm.scan_a[warp] = ia, sm.scan_b[warp] = ib;
  __syncthreads();
  unsigned long long wa = 0, wb = 0;
  for (int w = 0; w < warp; ++w) wa += sm.scan_a[w], wb += sm.scan_b[w];
  a = wa + ia - a, b = wb + ib - b;
}

// The leader block (all its threads): the first bin of (cnt, mass) whose inclusive count (by_mass
// false) or mass reaches `need`, into sm.pick; pick.bin = kBins when the total is below need.
// Thread t holds bins 2t and 2t + 1; exactly one thread sees the crossing.
__device__ inline void walk_bins(const uint32_t* cnt, const unsigned long long* mass, bool by_mass,
                                 unsigned long long need, Smem& sm) {
  const int b0 = 2 * static_cast<int>(threadIdx.x);
  const uint32_t c[2] = {cnt[b0], cnt[b0 + 1]};
  const unsigned long long m[2] = {mass[b0], mass[b0 + 1]};
  unsigned long long ec = static_cast<unsigned long long>(c[0]) + c[1], em = m[0] + m[1];
  if (threadIdx.x == 0) sm.pick.bin = kBins;  // ordered before the writer by the scan's barriers
  block_exclusive_scan2(ec, em, sm);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const unsigned long long before = by_mass ? em : ec, w = by_mass ? m[k] : c[k];
    if (before < need && before + w >= need) sm.pick = BinPick{static_cast<uint32_t>(b0 + k), c[k], ec, em};
    ec += c[k], em += m[k];
  }
  __syncthreads();
}

// The leader block (all its threads): sorts the sm.n_cand candidates (order key << 32 | ~id) by
// the order and finds the one where base + the inclusive count (by_mass false) or mass reaches
// `need`, with base_n / base_m the count and mass of the order before the candidates; into sm.pos
// (pos.id = kAllIds if none does).
__device__ inline void resolve_candidates(Smem& sm, bool by_mass, unsigned long long need, unsigned long long base_n,
                                          unsigned long long base_m, float top, double inv_t) {
  const int n = sm.n_cand;
  int size = 2;
  while (size < n) size <<= 1;
  for (int i = n + static_cast<int>(threadIdx.x); i < size; i += kThreads) sm.cand[i] = 0;  // below every token
  if (threadIdx.x == 0) sm.pos.id = kAllIds;
  __syncthreads();
  // Bitonic sort, descending (a larger key is earlier; equal keys: a larger ~id, a lower id).
  for (int k = 2; k <= size; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kThreads) {
        const int l = i ^ j;
        if (l <= i) continue;
        const unsigned long long a = sm.cand[i], b = sm.cand[l];
        if ((i & k) == 0 ? a < b : a > b) sm.cand[i] = b, sm.cand[l] = a;
      }
      __syncthreads();
    }
  const int e0 = 4 * static_cast<int>(threadIdx.x);
  unsigned long long q[4], ec = 0, em = 0;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int e = e0 + u;
    q[u] = e < n ? sampling::mass_q32(sampling::key_value(static_cast<uint32_t>(sm.cand[e] >> 32)), top, inv_t) : 0;
    ec += e < n ? 1 : 0, em += q[u];
  }
  block_exclusive_scan2(ec, em, sm);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int e = e0 + u;
    if (e >= n) break;
    const unsigned long long before = by_mass ? base_m + em : base_n + ec, w = by_mass ? q[u] : 1;
    if (before < need && before + w >= need) {
      const unsigned long long c = sm.cand[e];
      sm.pos = Position{static_cast<uint32_t>(c >> 32), ~static_cast<uint32_t>(c), base_n + ec + 1, base_m + em + q[u]};
    }
    ec += 1, em += q[u];
  }
  __syncthreads();
}

}  // namespace moelora::cuda::sample_detail
