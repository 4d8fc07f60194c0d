// Device sampling (sampling.cuh). One thread-block cluster of C blocks per row (C = 2, 4, 8 or 16,
// chosen by the backend through cuda_plan::choose_sample_cluster): each block takes every C-th
// 512-wide slice of the vocabulary, and the row's reductions and radix histograms are combined in
// the leader block's shared memory (distributed shared memory). A row's time is its blocks'
// instruction stream (~150 instructions per token and pass; ncu, bench/RESULTS.md), so few rows
// get 16 multiprocessors each and many rows fewer. The kernel is held to 64 registers so that two
// blocks share an SM: at 123 registers (one block per SM) 256 rows took 4.0 ms instead of 3.2.
//
// The result is bit-identical for every C (so a row's token and logprobs never depend on how many
// rows share its batch): every decision is an exact integer sum or an exact comparison, and the one
// floating-point reduction, the raw log-sum-exp, is always taken over the same fixed partition of
// the vocabulary (kThreads * kMaxCluster lanes, reduced in one fixed tree), whatever C is.
//
// Every vocabulary loop (for_row) loads kUnroll values per thread before using them, so a pass
// waits for memory once per kUnroll elements instead of once per element, and keeps whole warps
// converged for the warp intrinsics of the histogram. Only the first pass over the row and the
// first radix histogram touch every token with their full work; the later radix passes and the
// Gumbel draw select few tokens (the boundary's digit prefix, the kept set), and for_row_sparse
// queues those per warp so that their body (f64 exp and histogram update, or the Philox draw) runs
// once per selected token rather than once per warp that holds one.
#include <cooperative_groups.h>

#include <cfloat>
#include <climits>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/sampling.cuh"

namespace moelora::cuda {
namespace {

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

// Shared memory of every block; the `row_*` fields are only used in the leader (rank 0) block,
// where the cluster combines its blocks' parts.
struct Smem {
  // This block's histogram and warp partials.
  uint32_t cnt[256];
  unsigned long long mass[256];
  float red_f[kWarps];
  double red_d[kWarps];
  uint32_t red_u[kWarps];
  uint32_t red_i[kWarps];
  // Leader only: the row's histogram and selection state.
  uint32_t row_cnt[256];
  unsigned long long row_mass[256];
  unsigned long long need, tie_mass;
  uint32_t digit, tie_cnt;
  int done;
  // Leader only: one part per block of the cluster (the log-sum-exp: per virtual block).
  KeyId part_first[kMaxCluster];
  float part_pmax[kMaxCluster];
  Lse part_lse[kMaxCluster];
  Lse part_own[kMaxCluster / kMinCluster];  // every block: its virtual blocks' parts, before the leader runs
  double part_key[kMaxCluster];
  int part_best[kMaxCluster];
  int n_top;
  uint32_t top_key[kMaxTopLogprobs];
  int top_id[kMaxTopLogprobs];
  // Each warp's queue of the tokens a sparse pass selected (for_row_sparse): up to 31 carried over
  // plus kUnroll * 32 new ones per step.
  float stage_v[kWarps][kStage];
  uint32_t stage_i[kWarps][kStage];
};

// Adds (count 1, mass q) of every active lane to this block's bin `bin`, one shared atomic per
// distinct bin of the warp (logits crowd into few bins in the first passes, where per-lane
// atomics serialise).
__device__ void hist_add(Smem& s, bool active, uint32_t bin, bool by_mass, unsigned long long q) {
  const unsigned act = __ballot_sync(kFull, active);
  if (!act) return;
  const unsigned peers = __match_any_sync(kFull, active ? bin : 0xFFFFFFFFu);
  const int lane = threadIdx.x & 31;
  const bool leader = active && lane == __ffs(peers) - 1;
  if (leader) atomicAdd(&s.cnt[bin], static_cast<uint32_t>(__popc(peers)));
  if (!by_mass) return;
  // Past the first pass the active lanes mostly fall in different bins: one atomic each is then
  // cheaper than a reduction per group (integer sums: the same result either way).
  if (__popc(__ballot_sync(kFull, leader)) > kMaxAggregatedGroups) {
    if (active && q) atomicAdd(&s.mass[bin], q);
    return;
  }
  // q <= 2^32: split so that 32-lane sums fit in 32 bits.
  const unsigned lo = active ? static_cast<unsigned>(q & 0xFFFFu) : 0u;
  const unsigned hi = active ? static_cast<unsigned>(q >> 16) : 0u;
  unsigned todo = act;
  while (todo) {
    const int l = __ffs(todo) - 1;
    const unsigned g = __shfl_sync(kFull, peers, l);
    const bool mine = (g >> lane) & 1u;
    const unsigned ls = __reduce_add_sync(kFull, mine ? lo : 0u);
    const unsigned hs = __reduce_add_sync(kFull, mine ? hi : 0u);
    if (lane == l && (ls | hs)) atomicAdd(&s.mass[bin], (static_cast<unsigned long long>(hs) << 16) + ls);
    todo &= ~g;
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
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * stride;
      v[u] = i < vocab ? p[i] : 0.0f;
    }
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
// sums, and the Gumbel winner is order-independent).
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
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * stride;
      v[u] = i < vocab ? p[i] : 0.0f;
    }
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

// Walks the row's bins (from the best) to the one where the running total reaches L.need; leaves
// its digit and the need left inside it. One warp of the leader: lane l holds the bins 8l..8l+7 of
// the walk order, a prefix sum over the lanes finds the lane of the boundary, which walks its 8.
// Exactly the serial walk: the first bin b with w_b > 0 and (sum of the w before b) + w_b >= need.
__device__ void walk(Smem& L, bool by_mass, bool ascending) {
  const int lane = threadIdx.x & 31;
  unsigned long long w[8], sum = 0;
  bool any_cnt = false;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int j = lane * 8 + k, b = ascending ? j : 255 - j;
    w[k] = by_mass ? L.row_mass[b] : L.row_cnt[b];
    sum += w[k];
    any_cnt |= L.row_cnt[b] != 0;
  }
  unsigned long long incl = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  const unsigned long long need = L.need;
  __syncwarp();  // every lane has read the bins and the need before one lane writes the result
  const unsigned hit = __ballot_sync(kFull, incl >= need && sum > 0);
  if (hit) {
    if (lane == __ffs(hit) - 1) {
      unsigned long long cum = incl - sum;
      for (int k = 0; k < 8; ++k) {
        const int j = lane * 8 + k, b = ascending ? j : 255 - j;
        if (w[k] > 0 && cum + w[k] >= need) {
          L.digit = b, L.need = need - cum, L.tie_cnt = L.row_cnt[b], L.tie_mass = L.row_mass[b];
          break;
        }
        cum += w[k];
      }
    }
  } else {
    // Unreachable when need <= the total (the callers guarantee it); keep the last non-empty bin.
    const unsigned nz = __ballot_sync(kFull, any_cnt);
    if (nz && lane == 31 - __clz(nz)) {
      for (int k = 7; k >= 0; --k) {
        const int j = lane * 8 + k, b = ascending ? j : 255 - j;
        if (L.row_cnt[b]) {
          L.digit = b, L.need = 1, L.tie_cnt = L.row_cnt[b], L.tie_mass = L.row_mass[b];
          break;
        }
      }
    }
  }
  __syncwarp();
}

// The leader's row histogram is cleared by the warp that last read it (kernel start, and after
// every walk), before the cluster barrier that lets the blocks add to it again.
__device__ void clear_row_histogram(Smem& L) {
  for (int b = threadIdx.x & 31; b < 256; b += 32) L.row_cnt[b] = 0, L.row_mass[b] = 0;
}

// One histogram pass over the row: this block's tokens for which `bin_of(i, v, &bin)` is true,
// summed into the leader's (already clear) row histogram. Ends with the row histogram complete.
// `sparse`: visit only the tokens bin_of selects (for_row_sparse), for passes that select a small
// part of the row; otherwise every token (the first pass over the whole row, where all are).
template <int C, typename Bin>
__device__ void row_histogram(const float* p, int vocab, bool by_mass, float pmax, double inv_t, bool sparse, Smem& sm,
                              Smem* L, cg::cluster_group& cluster, Bin bin_of) {
  for (int b = threadIdx.x; b < 256; b += kThreads) sm.cnt[b] = 0, sm.mass[b] = 0;
  __syncthreads();
  const int rank = static_cast<int>(cluster.block_rank());
  if (sparse) {
    for_row_sparse<C>(
        p, vocab, rank, sm,
        [&](int i, float v) {
          uint32_t bin;
          return bin_of(i, v, &bin);
        },
        [&](int i, float v, bool ok) {
          uint32_t bin = 0;
          unsigned long long q = 0;
          if (ok) {
            bin_of(i, v, &bin);
            if (by_mass) q = sampling::mass_q32(v, pmax, inv_t);
          }
          hist_add(sm, ok, bin, by_mass, q);
        });
  } else {
    for_row<C>(p, vocab, rank, [&](int, int i, float v, bool in_range) {
      bool act = false;
      uint32_t bin = 0;
      unsigned long long q = 0;
      if (in_range) {
        act = bin_of(i, v, &bin);
        if (act && by_mass) q = sampling::mass_q32(v, pmax, inv_t);
      }
      hist_add(sm, act, bin, by_mass, q);
    });
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += kThreads) {
    if (sm.cnt[b]) atomicAdd(&L->row_cnt[b], sm.cnt[b]);
    if (sm.mass[b]) atomicAdd(&L->row_mass[b], sm.mass[b]);
  }
  cluster.sync();
}

// The boundary of the first tokens (order: key desc, id asc) inside `outer` whose count (by_mass
// false) or fixed-point mass (true) reaches `need`. With by_mass, need = ceil(top_p * Z) with Z
// the mass inside `outer`, from the first pass; a zero target cuts after the row's first token.
template <int C>
__device__ Cut radix_select(const float* p, int vocab, const Cut& outer, bool by_mass, float pmax, double inv_t,
                            unsigned long long need, float top_p, KeyId first, Smem& sm, Smem* L,
                            cg::cluster_group& cluster) {
  const bool lead_warp = cluster.block_rank() == 0 && threadIdx.x < 32;
  const int lane = threadIdx.x & 31;
  uint32_t prefix = 0, mask = 0;
  for (int d = 3; d >= 0; --d) {
    const int shift = 8 * d;
    // Only the first pass without an outer cut selects every token.
    const bool sparse = d != 3 || outer.active;
    row_histogram<C>(p, vocab, by_mass, pmax, inv_t, sparse, sm, L, cluster, [&](int i, float v, uint32_t* bin) {
      const uint32_t k = order_key(v);
      *bin = (k >> shift) & 255u;
      return (k & mask) == prefix && outer.inside(k, i);
    });
    if (lead_warp) {
      unsigned long long z = 0;  // the mass inside `outer` (an exact integer sum, any order)
      if (d == 3 && by_mass) {
        for (int b = lane; b < 256; b += 32) z += L->row_mass[b];
        for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(kFull, z, o);
      }
      if (lane == 0) {
        L->done = 0;
        if (d == 3) {
          L->need = need;
          if (by_mass) {
            L->need = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(z)));
            if (L->need == 0) L->done = 1;  // the first token alone reaches a zero target
          }
        }
      }
      __syncwarp();
      if (!L->done) walk(*L, by_mass, false);
      clear_row_histogram(*L);
    }
    cluster.sync();
    if (L->done) {
      Cut c;
      c.active = true, c.key = first.key, c.id = first.id;
      return c;
    }
    prefix |= L->digit << shift;
    mask |= 255u << shift;
  }
  // Among the tokens tied at key `prefix`: how many to take, then which ids.
  const unsigned long long rest = L->need, tie_cnt = L->tie_cnt, tie_mass = L->tie_mass;
  unsigned long long take = rest;
  if (by_mass) {
    const unsigned long long q = tie_cnt ? tie_mass / tie_cnt : 0;
    take = q ? (rest + q - 1) / q : tie_cnt;
  }
  Cut c;
  c.active = true;
  c.key = prefix;
  if (take >= tie_cnt) return c;  // c.id = every id
  uint32_t id_prefix = 0, id_mask = 0;
  for (int d = 2; d >= 0; --d) {  // ids < 2^24
    const int shift = 8 * d;
    row_histogram<C>(p, vocab, false, pmax, inv_t, true, sm, L, cluster, [&](int i, float v, uint32_t* bin) {
      *bin = (static_cast<uint32_t>(i) >> shift) & 255u;
      return order_key(v) == prefix && outer.inside(prefix, i) && (static_cast<uint32_t>(i) & id_mask) == id_prefix;
    });
    if (lead_warp) {
      if (d == 2 && lane == 0) L->need = take;
      __syncwarp();
      walk(*L, false, true);
      clear_row_histogram(*L);
    }
    cluster.sync();
    id_prefix |= L->digit << shift;
    id_mask |= 255u << shift;
  }
  c.id = id_prefix;
  return c;
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

// -log(-log(u)) in f32, within 2e-5 of the f64 value for every u the draw can give
// ((k + 1/2) 2^-53): -log(u) is taken as log1p(-(1 - u)) for u >= 1/2, where 1 - u is exact in
// f64, so no precision is lost near u = 1; f32 logf / log1pf are within 2 ulp, the conversions
// within 2^-24 relative, so -log(u) is within ~3e-7 relative and the outer log within ~3e-7 + 2
// ulp of |G| <= 38 (7.6e-6) absolute. An estimate below the best estimate by more than twice
// that bound (kGumbelMargin, with a 25x reserve) cannot belong to the row's winner.
__device__ float gumbel_estimate(double u) {
  const float neg_log_u = u < 0.5 ? -logf(static_cast<float>(u)) : -log1pf(-static_cast<float>(1.0 - u));
  return -logf(neg_log_u);
}
constexpr double kGumbelMargin = 1e-3;

// Best Gumbel key (larger key, then lower id; id INT_MAX = none).
__device__ void best_merge(double& key, int& id, double ok, int oi) {
  if (oi != INT_MAX && (id == INT_MAX || ok > key || (ok == key && oi < id))) key = ok, id = oi;
}

// A processed row: the raw row (or -inf everywhere for restrict_to_allowed), and for a row with a
// penalty slot every token its cell gives an edit, edited from the raw value (the row's own edits
// follow in edit_kernel, which overwrites their tokens with the merged edit).
__global__ void __launch_bounds__(256) process_kernel(ProcessParams p) {
  const int pr = blockIdx.y;
  const int r = p.processed_rows[pr];
  const DeviceSampleRow& row = p.rows[r];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  float* out = p.processed + static_cast<int64_t>(pr) * p.vocab;
  const bool restrict_rows = row.restrict_to_allowed != 0;
  const uint32_t* cells = row.penalty_slot >= 0 ? p.penalty_cells + static_cast<int64_t>(row.penalty_slot) * p.vocab : nullptr;
  const bool ctx = penalty_wants_context(row.repetition), outp = penalty_wants_output(row.presence, row.frequency);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.vocab; i += gridDim.x * blockDim.x) {
    float v = restrict_rows ? -INFINITY : raw[i];
    if (cells && !restrict_rows) {
      const uint32_t cell = cells[i];
      if (penalty_cell_edits(cell, ctx, outp)) {
        LogitEdit e;
        e.token = i;
        v = sampling::apply_edit(v, penalty_merge(e, cell, ctx, outp), row.presence, row.frequency, row.repetition);
      }
    }
    out[i] = v;
  }
}

__global__ void __launch_bounds__(256) edit_kernel(ProcessParams p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_edits) return;
  const int r = p.edit_rows[e];
  const DeviceSampleRow& row = p.rows[r];
  LogitEdit ed = p.edits[e];
  if (row.restrict_to_allowed && !ed.allowed) return;
  if (row.penalty_slot >= 0)
    ed = penalty_merge(ed, p.penalty_cells[static_cast<int64_t>(row.penalty_slot) * p.vocab + ed.token],
                       penalty_wants_context(row.repetition), penalty_wants_output(row.presence, row.frequency));
  const float raw = p.logits[static_cast<int64_t>(r) * p.ld + ed.token];
  p.processed[static_cast<int64_t>(row.processed) * p.vocab + ed.token] =
      sampling::apply_edit(raw, ed, row.presence, row.frequency, row.repetition);
}

__global__ void __launch_bounds__(256) penalty_commit_kernel(const DeviceSampleRow* rows, const DeviceSampleResult* out,
                                                             int num_rows, uint32_t* cells, int vocab) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows || rows[r].penalty_slot < 0) return;
  const int token = out[r].token;
  if (token < 0 || token >= vocab) return;  // never (the sampler draws inside the row); no stray write if it did
  uint32_t& cell = cells[static_cast<int64_t>(rows[r].penalty_slot) * vocab + token];
  cell = penalty_count(cell, /*generated=*/true);  // rows never share a slot (check_sample_rows)
}

// Block (x, s): cells x * 1024 .. of slot slots[s], 4 per thread.
__global__ void __launch_bounds__(256) penalty_clear_kernel(uint32_t* cells, int vocab, const int32_t* slots) {
  uint32_t* slot = cells + static_cast<int64_t>(slots[blockIdx.y]) * vocab;
  for (int i = blockIdx.x * 1024 + threadIdx.x, e = min(vocab, (blockIdx.x + 1) * 1024); i < e; i += 256) slot[i] = 0u;
}

__global__ void __launch_bounds__(256) penalty_scatter_kernel(uint32_t* cells, int vocab, const int32_t* tokens,
                                                              const int32_t* slot_gen, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t* cell = cells + static_cast<int64_t>(slot_gen[i] >> 1) * vocab + tokens[i];
  if (slot_gen[i] & 1) atomicAdd(cell, 1u);  // penalty_count, split into two atomics (counts < 2^31)
  atomicOr(cell, kPenaltyInContext);
}

template <int C>
__global__ void __launch_bounds__(kThreads, 2) sample_kernel(SampleParams p) {  // 2 blocks/SM: <= 64 registers
  constexpr int kVirtual = kMaxCluster / C;  // log-sum-exp virtual blocks held by each block
  static_assert(C >= kMinCluster, "more virtual blocks than part_own holds");
  __shared__ Smem sm;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  Smem* L = cluster.map_shared_rank(&sm, 0);
  const int r = blockIdx.x / C;
  // Read where used (not held in registers through the kernel: it is held to 64 of them).
  const DeviceSampleRow& row = p.params[r];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  const float* x = row.processed >= 0 ? p.processed + static_cast<int64_t>(row.processed) * p.vocab : raw;
  const int V = p.vocab;
  if (rank == 0 && threadIdx.x < 32) clear_row_histogram(sm);  // published by the barrier below
  // Distributed shared memory may only be touched once every block of the cluster runs: arrive
  // now, wait just before pass 1 writes its parts into the leader.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // Pass 1: the order's first token, the processed maximum, and the raw log-sum-exp, summed per
  // virtual block: this block holds the virtual blocks rank + a * C (a < kVirtual), and thread t
  // of virtual block b owns the tokens i = b * kThreads + t + m * kThreads * kMaxCluster. One sweep
  // per virtual block (a single accumulator in registers, not kVirtual of them), each lane summing
  // its tokens in increasing i as the partition prescribes.
  KeyId first{0, kAllIds};
  float pmax = -INFINITY;
  const bool processed = x != raw;
  for (int a = 0; a < kVirtual; ++a) {
    constexpr int vstride = kThreads * kMaxCluster;
    Lse acc{-INFINITY, 0.0};
    for (int i0 = (rank + a * C) * kThreads + static_cast<int>(threadIdx.x); i0 < V; i0 += vstride * kUnroll) {
      float wv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * vstride;
        wv[u] = i < V ? raw[i] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * vstride;
        if (i >= V) break;
        const float w = wv[u];
        const float v = processed ? x[i] : w;
        first = better(first, KeyId{order_key(v), static_cast<uint32_t>(i)});
        if (v > pmax) pmax = v;
        if (w > -INFINITY) {
          if (w > acc.m) {
            acc.s = (acc.m == -INFINITY ? 0.0 : acc.s * static_cast<double>(expf(acc.m - w))) + 1.0;
            acc.m = w;
          } else {
            acc.s += static_cast<double>(expf(w - acc.m));
          }
        }
      }
    }
    const Lse part = block_lse(acc, sm);
    if (threadIdx.x == 0) sm.part_own[a] = part;
  }
  first = block_best(first, sm);
  pmax = block_reduce(pmax, sm.red_f, [](float a, float b) { return fmaxf(a, b); });
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  if (threadIdx.x == 0)
    for (int a = 0; a < kVirtual; ++a) L->part_lse[rank + a * C] = sm.part_own[a];
  if (threadIdx.x == 0) L->part_first[rank] = first, L->part_pmax[rank] = pmax;
  cluster.sync();
  first = L->part_first[0], pmax = L->part_pmax[0];
  for (int b = 1; b < C; ++b) first = better(first, L->part_first[b]), pmax = fmaxf(pmax, L->part_pmax[b]);
  // The row's log-sum-exp is taken from the parts at the end, by the one thread that writes the
  // results (the leader's parts stay in place).
  const auto row_log_z = [&] {
    Lse row_lse = L->part_lse[0];
    for (int b = 1; b < kMaxCluster; ++b) row_lse = lse_merge(row_lse, L->part_lse[b]);  // fixed order
    return static_cast<double>(row_lse.m) + log(row_lse.s);
  };

  int token = static_cast<int>(first.id);
  if (row.temperature > 0.0f) {
    const double inv_t = 1.0 / static_cast<double>(row.temperature);
    Cut cut_k, cut_p;
    if (row.top_k > 0 && row.top_k < V)
      cut_k = radix_select<C>(x, V, Cut{}, false, pmax, inv_t, static_cast<unsigned long long>(row.top_k), -1.0f,
                              first, sm, L, cluster);
    if (row.top_p < 1.0f) cut_p = radix_select<C>(x, V, cut_k, true, pmax, inv_t, 0, row.top_p, first, sm, L, cluster);
    // Gumbel-max over the kept, finite tokens. The exact key (two f64 logs) is evaluated only for
    // tokens whose f32 estimate is within kGumbelMargin of the best estimate this thread has seen:
    // the row's winner always is (see gumbel_estimate), and the winner among the evaluated tokens
    // is taken on exact keys, so the result is the reference's.
    const float min_p = row.min_p;
    const uint64_t seed = row.seed, step = row.step;
    const double min_q = static_cast<double>(min_p) * 4294967296.0;
    double best_key = -DBL_MAX, best_estimate = -DBL_MAX;
    int best = INT_MAX;
    // Only the kept tokens are visited (for_row_sparse): the Philox draw is paid per kept token.
    for_row_sparse<C>(
        x, V, rank, sm,
        [&](int i, float v) {
          const uint32_t k = order_key(v);
          return isfinite(v) && cut_k.inside(k, i) && cut_p.inside(k, i);
        },
        [&](int i, float v, bool ok) {
          if (!ok) return;
          if (min_p > 0.0f && static_cast<double>(sampling::mass_q32(v, pmax, inv_t)) < min_q) return;
          const double u = sampling::uniform(seed, step, static_cast<uint32_t>(i));
          const double estimate = __dadd_rn(__dmul_rn(static_cast<double>(v), inv_t), gumbel_estimate(u));
          if (estimate < best_estimate - kGumbelMargin) return;
          best_estimate = fmax(best_estimate, estimate);
          best_merge(best_key, best, sampling::gumbel_key_of(v, inv_t, u), i);
        });
    for (int o = 16; o > 0; o >>= 1)
      best_merge(best_key, best, __shfl_xor_sync(kFull, best_key, o), __shfl_xor_sync(kFull, best, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) sm.red_d[warp] = best_key, sm.red_i[warp] = static_cast<uint32_t>(best);
    __syncthreads();
    if (threadIdx.x == 0) {
      best_key = sm.red_d[0], best = static_cast<int>(sm.red_i[0]);
      for (int w = 1; w < kWarps; ++w) best_merge(best_key, best, sm.red_d[w], static_cast<int>(sm.red_i[w]));
      L->part_key[rank] = best_key, L->part_best[rank] = best;
    }
    cluster.sync();
    best_key = L->part_key[0], best = L->part_best[0];
    for (int b = 1; b < C; ++b) best_merge(best_key, best, L->part_key[b], L->part_best[b]);
    if (best != INT_MAX) token = best;
  }

  DeviceSampleResult* out = p.out + r;
  const int n = min(row.logprobs, min(V, kMaxTopLogprobs));
  if (n > 0) {
    // Count mode never takes radix_select's zero-target exit, so its `first` argument is unused.
    const Cut cut = radix_select<C>(raw, V, Cut{}, false, 0.0f, 1.0, static_cast<unsigned long long>(n), -1.0f,
                                    KeyId{0, kAllIds}, sm, L, cluster);
    if (rank == 0 && threadIdx.x == 0) L->n_top = 0;
    cluster.sync();
    for_row<C>(raw, V, rank, [&](int, int i, float w, bool in_range) {
      if (!in_range) return;
      const uint32_t k = order_key(w);
      if (cut.inside(k, i)) {
        const int slot = atomicAdd(&L->n_top, 1);
        if (slot < kMaxTopLogprobs) L->top_key[slot] = k, L->top_id[slot] = i;
      }
    });
    cluster.sync();
    if (rank == 0 && threadIdx.x == 0) {
      const double log_z = row_log_z();
      const int m = min(sm.n_top, n);
      for (int a = 1; a < m; ++a)  // insertion sort by (key desc, id asc)
        for (int b = a; b > 0; --b) {
          const bool swap = sm.top_key[b] > sm.top_key[b - 1] ||
                            (sm.top_key[b] == sm.top_key[b - 1] && sm.top_id[b] < sm.top_id[b - 1]);
          if (!swap) break;
          const uint32_t tk = sm.top_key[b];
          const int ti = sm.top_id[b];
          sm.top_key[b] = sm.top_key[b - 1], sm.top_id[b] = sm.top_id[b - 1];
          sm.top_key[b - 1] = tk, sm.top_id[b - 1] = ti;
        }
      for (int a = 0; a < m; ++a) {
        out->top_ids[a] = sm.top_id[a];
        out->top_logprobs[a] = static_cast<float>(static_cast<double>(raw[sm.top_id[a]]) - log_z);
      }
    }
  }
  if (rank == 0 && threadIdx.x == 0) {
    out->token = token;
    out->logprob = static_cast<float>(static_cast<double>(raw[token]) - row_log_z());
  }
  cluster.sync();  // no block leaves while another may still read or write its shared memory
}

template <int C>
cudaLaunchConfig_t cluster_config(int rows, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(rows * C);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (C > 8) {  // beyond the portable 8: opt in (the attribute is per device context, so with each launch)
    MOELORA_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel<C>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  return cfg;
}

template <int C>
void launch_sample_cluster(const SampleParams& p, cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config<C>(p.rows, stream, attr);
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_kernel<C>, p));
  MOELORA_CUDA_CHECK_LAUNCH();
}

// 0 when the device cannot run clusters of C blocks of this kernel.
template <int C>
int max_active_clusters() {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_config<C>(1, nullptr, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, sample_kernel<C>, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so later checks do not see it
    return 0;
  }
  return n;
}

}  // namespace

void launch_process_logits(const ProcessParams& p, cudaStream_t stream) {
  if (p.num_processed > 0) {
    const dim3 grid((p.vocab + 256 * 8 - 1) / (256 * 8), p.num_processed);
    process_kernel<<<grid, 256, 0, stream>>>(p);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
  if (p.num_edits > 0) {
    edit_kernel<<<(p.num_edits + 255) / 256, 256, 0, stream>>>(p);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
}

void launch_penalty_commit(const DeviceSampleRow* rows, const DeviceSampleResult* out, int num_rows, uint32_t* cells,
                           int vocab, cudaStream_t stream) {
  if (num_rows <= 0) return;
  penalty_commit_kernel<<<(num_rows + 255) / 256, 256, 0, stream>>>(rows, out, num_rows, cells, vocab);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_penalty_reset(uint32_t* cells, int vocab, const int32_t* slots, int num_slots, const int32_t* tokens,
                          const int32_t* slot_gen, int n, cudaStream_t stream) {
  MOELORA_CHECK(num_slots >= 0 && num_slots <= 65535 && vocab > 0);
  if (num_slots > 0) {
    penalty_clear_kernel<<<dim3((vocab + 1023) / 1024, num_slots), 256, 0, stream>>>(cells, vocab, slots);
    MOELORA_CUDA_CHECK_LAUNCH();
  }
  if (n <= 0) return;
  penalty_scatter_kernel<<<(n + 255) / 256, 256, 0, stream>>>(cells, vocab, tokens, slot_gen, n);
  MOELORA_CUDA_CHECK_LAUNCH();
}

std::array<int, 5> sample_max_active_clusters() {
  return {0, max_active_clusters<2>(), max_active_clusters<4>(), max_active_clusters<8>(), max_active_clusters<16>()};
}

void launch_sample(const SampleParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  MOELORA_CHECK(p.vocab > 0 && p.vocab < (1 << 24) && p.out != nullptr && p.params != nullptr);
  switch (p.cluster) {
    case 2: launch_sample_cluster<2>(p, stream); break;
    case 4: launch_sample_cluster<4>(p, stream); break;
    case 8: launch_sample_cluster<8>(p, stream); break;
    case 16: launch_sample_cluster<16>(p, stream); break;
    default: MOELORA_CHECK_MSG(false, "sampling cluster size {} is not 2, 4, 8 or 16", p.cluster);
  }
}

}  // namespace moelora::cuda
