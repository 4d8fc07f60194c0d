// The sampling kernel's shared pieces (sample_kernel.cu, sample_radix.cuh): its block and cluster
// shape, the shared memory of a block, the vocabulary loops and the block reductions. Device code
// for those two files only.
#pragma once

#include <cooperative_groups.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "backends/cuda/kernels/sampling.cuh"

namespace moelora::cuda::sample_detail {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMinCluster = 2;   // a smaller one would need more log-sum-exp partials per thread
constexpr int kMaxCluster = 16;  // a non-portable cluster size (Hopper allows 16 with an opt-in)
// The log-sum-exp's partition: lane j of kThreads * kMaxCluster owns the tokens i with
// i % (kThreads * kMaxCluster) == j and sums them in increasing i; lanes are reduced kThreads at a
// time as one block would (shuffle tree, then warps in order) and the kMaxCluster results in
// order. Blocks of a smaller cluster hold several of these "virtual blocks".
constexpr int kUnroll = 8;  // loads in flight per thread in a vocabulary loop; a multiple of 16 / C
constexpr uint32_t kAllIds = 0xFFFFFFFFu;
constexpr unsigned kFull = 0xffffffffu;
// A warp's histogram update adds masses group by group (warp reductions) while its lanes fall in at
// most this many distinct bins, and lane by lane (shared atomics) beyond.
constexpr int kMaxAggregatedGroups = 4;
constexpr int kStage = kUnroll * 32 + 32;  // a warp's queue in for_row_sparse
// The binned selection (sample_kernel.cu): kBins bins of a row's tokens by their distance below
// the largest finite value (the last bin also holds -inf and NaN), and a bin of at most
// kMaxCandidates tokens resolved exactly by sorting its tokens in shared memory.
constexpr int kBins = 1024;
constexpr int kMaxCandidates = 2048;
static_assert(kBins == 2 * kThreads, "walk_bins gives each thread two bins");
static_assert(kMaxCandidates == 4 * kThreads, "resolve_candidates gives each thread four candidates");

using sampling::order_key;

// Token i is inside a cut when its order key is above the boundary key, or equal with id <= the
// boundary id. An inactive cut holds every token.
struct Cut {
  bool active = false;
  uint32_t key = 0, id = kAllIds;
  __device__ bool inside(uint32_t k, uint32_t i) const { return !active || k > key || (k == key && i <= id); }
};

struct KeyId {
  uint32_t key, id;
};
__device__ KeyId better(KeyId a, KeyId b) { return (b.key > a.key || (b.key == a.key && b.id < a.id)) ? b : a; }

struct Lse {
  float m;
  double s;
};
__device__ Lse lse_merge(Lse a, Lse b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return Lse{m, a.s * static_cast<double>(expf(a.m - m)) + b.s * static_cast<double>(expf(b.m - m))};
}

// A position in the order: the token (key, id) where a cumulative count or mass first reaches a
// target, with the count n and the mass of the prefix it ends.
struct Position {
  uint32_t key, id;
  unsigned long long n, mass;
};

// One bin the leader's walk found (walk_bins): the first whose inclusive sum reaches the need.
struct BinPick {
  uint32_t bin, cnt;
  unsigned long long cnt_before, mass_before;
};

// Shared memory of every block (dynamic: ~90 KB); the leader-only fields are used in the leader
// (rank 0) block, where the cluster combines its blocks' parts.
struct Smem {
  // This block's histogram: the binned pass over the row, a bin's sub-bins, or (first 256 bins) a
  // radix pass.
  uint32_t cnt[kBins];
  unsigned long long mass[kBins];
  // Leader only: the row's binned histogram, kept through all the row's selections.
  uint32_t l1_cnt[kBins];
  unsigned long long l1_mass[kBins];
  // Leader only: one bin's sub-bins, or (first 256 bins) a radix pass's row histogram. Clear
  // between uses.
  uint32_t row_cnt[kBins];
  unsigned long long row_mass[kBins];
  // Leader only: a bin's tokens as (order key << 32 | ~id), sorted in place.
  unsigned long long cand[kMaxCandidates];
  int n_cand;
  BinPick pick;
  Position pos;
  unsigned long long z_all, n_minp;  // the row's mass, and the count min_p keeps
  // Block reductions' warp partials.
  float red_f[kWarps];
  double red_d[kWarps];
  uint32_t red_u[kWarps];
  uint32_t red_i[kWarps];
  unsigned long long scan_a[kWarps], scan_b[kWarps];
  // Leader only: the radix selection's state.
  unsigned long long need, tie_mass;
  uint32_t digit, tie_cnt;
  // Leader only: one part per block of the cluster (the log-sum-exp: per virtual block).
  KeyId part_first[kMaxCluster];
  float part_pmax[kMaxCluster], part_vmin[kMaxCluster];
  Lse part_lse[kMaxCluster];
  Lse part_own[kMaxCluster / kMinCluster];  // every block: its virtual blocks' parts, before the leader runs
  unsigned long long part_n[kMaxCluster], part_m[kMaxCluster];  // a radix position's prefix, per block
  int n_top;
  uint32_t top_key[kMaxTopLogprobs];
  int top_id[kMaxTopLogprobs];
  // Each warp's queue of the tokens a sparse radix pass selected (for_row_sparse): up to 31
  // carried over plus kUnroll * 32 new ones per step.
  float stage_v[kWarps][kStage];
  uint32_t stage_i[kWarps][kStage];
};


// v[u] = p[base + u * stride] for u < kUnroll (0 past `vocab`), every load issued before any is used.
__device__ __forceinline__ void load_slice(const float* p, int base, int stride, int vocab, float (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int i = base + u * stride;
    v[u] = i < vocab ? p[i] : 0.0f;
  }
}

// Calls f(i, v, in_range) for every token i of the row this thread owns in a cluster of C blocks:
// i = rank * kThreads + threadIdx.x + k * C * kThreads, k = 0, 1, ... in order, with v = p[i]
// (0 past the end). kUnroll loads are issued before any is used. The loop bound is the same for
// every thread of the block, and f is called by all lanes together (in_range false past the end),
// so f may use warp intrinsics. `u` (0..kUnroll-1) is k % kUnroll.
template <int C, typename F>
__device__ __forceinline__ void for_row(const float* p, int vocab, int rank, F f) {
  constexpr int stride = C * kThreads;
  for (int block_base = rank * kThreads; block_base < vocab; block_base += stride * kUnroll) {
    const int base = block_base + static_cast<int>(threadIdx.x);
    float v[kUnroll];
    load_slice(p, base, stride, vocab, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(u, base + u * stride, v[u], base + u * stride < vocab);
  }
}

// The tokens of for_row for which `pred(i, v)` holds, handed to f(i, v, ok) 32 at a time: each warp
// queues its selected tokens in shared memory (in order of selection) and calls f with all 32 lanes
// (ok false on lanes without a token, in the last call only) whenever 32 are queued, then once more
// for the rest. So f's work is paid per selected token, not per warp that holds one: a pass whose
// predicate keeps 5 % of the row runs its body ~20x less often. f may use warp intrinsics. Which
// lane sees which token differs from for_row; the callers' results do not depend on it (integer
// sums).
template <int C, typename Pred, typename F>
__device__ __forceinline__ void for_row_sparse(const float* p, int vocab, int rank, Smem& sm, Pred pred, F f) {
  constexpr int stride = C * kThreads;
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  float* qv = sm.stage_v[threadIdx.x >> 5];
  uint32_t* qi = sm.stage_i[threadIdx.x >> 5];
  int n = 0;  // queued tokens (the same in every lane)
  for (int block_base = rank * kThreads; block_base < vocab; block_base += stride * kUnroll) {
    const int base = block_base + static_cast<int>(threadIdx.x);
    float v[kUnroll];
    load_slice(p, base, stride, vocab, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * stride;
      const bool take = i < vocab && pred(i, v[u]);
      const unsigned m = __ballot_sync(kFull, take);
      if (take) {
        const int slot = n + __popc(m & below);
        qv[slot] = v[u], qi[slot] = static_cast<uint32_t>(i);
      }
      n += __popc(m);
    }
    if (n < 32) continue;
    __syncwarp();
    int r = 0;
    for (; r + 32 <= n; r += 32) f(static_cast<int>(qi[r + lane]), qv[r + lane], true);
    // Move the rest (< 32, from r >= 32) to the front of the queue.
    n -= r;
    float tv = 0.0f;
    uint32_t ti = 0;
    if (lane < n) tv = qv[r + lane], ti = qi[r + lane];
    __syncwarp();
    if (lane < n) qv[lane] = tv, qi[lane] = ti;
    __syncwarp();
  }
  if (n > 0) {
    __syncwarp();
    const bool ok = lane < n;
    f(ok ? static_cast<int>(qi[lane]) : 0, ok ? qv[lane] : 0.0f, ok);
  }
  __syncwarp();  // the queue is free for the next pass
}

// An exact 64-bit add into this block's shared memory as 32-bit atomics. Hopper has no native
// 64-bit shared-memory atomic add: ptxas emits a compare-and-swap loop (ATOMS.CAST.SPIN.64, seen in
// cuobjdump), which retries once per lane that hits the same address, and bins are hit by many lanes
// at once. The low word's add returns its old value, so the add knows whether it wrapped and carries
// into the high word (little-endian halves of the same 8 bytes): the words' total is exact. The
// halves are read only after a barrier, so they need not change together.
__device__ __forceinline__ void shared_add_u64(unsigned long long* p, unsigned long long q) {
  unsigned* w = reinterpret_cast<unsigned*>(p);
  const unsigned lo = static_cast<unsigned>(q), hi = static_cast<unsigned>(q >> 32);
  const unsigned old = atomicAdd(w, lo);
  const unsigned carry = old + lo < old ? 1u : 0u;
  if (hi + carry) atomicAdd(w + 1, hi + carry);
}

template <typename T, typename Op>
__device__ T block_reduce(T v, T* scratch, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = op(r, scratch[w]);  // fixed order: same result every run
  return r;
}

__device__ KeyId block_best(KeyId v, Smem& sm) {
  for (int o = 16; o > 0; o >>= 1) {
    const KeyId w{__shfl_xor_sync(0xffffffffu, v.key, o), __shfl_xor_sync(0xffffffffu, v.id, o)};
    v = better(v, w);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) sm.red_u[warp] = v.key, sm.red_i[warp] = v.id;
  __syncthreads();
  KeyId r{sm.red_u[0], sm.red_i[0]};
  for (int w = 1; w < kWarps; ++w) r = better(r, KeyId{sm.red_u[w], sm.red_i[w]});
  return r;
}

__device__ Lse block_lse(Lse v, Smem& sm) {
  for (int o = 16; o > 0; o >>= 1) v = lse_merge(v, Lse{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) sm.red_f[warp] = v.m, sm.red_d[warp] = v.s;
  __syncthreads();
  Lse r{sm.red_f[0], sm.red_d[0]};
  for (int w = 1; w < kWarps; ++w) r = lse_merge(r, Lse{sm.red_f[w], sm.red_d[w]});
  return r;
}

}  // namespace moelora::cuda::sample_detail
