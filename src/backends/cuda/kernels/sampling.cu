// Device sampling (sampling.cuh). One thread-block cluster of kCluster blocks per row: each block
// takes every kCluster-th slice of the vocabulary, and the row's reductions and radix histograms
// are combined in the leader block's shared memory (distributed shared memory), so one row is
// spread over kCluster multiprocessors (a single-block row took ~1.1 ms on the H200). Every
// vocabulary loop runs `for (base = ...; base < vocab; base += stride)` so whole warps stay
// converged for the warp intrinsics of the histogram.
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
constexpr int kCluster = 8;
constexpr int kStride = kThreads * kCluster;
constexpr uint32_t kAllIds = 0xFFFFFFFFu;

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
  // Leader only: one part per block of the cluster.
  KeyId part_first[kCluster];
  float part_pmax[kCluster];
  Lse part_lse[kCluster];
  double part_key[kCluster];
  int part_best[kCluster];
  int n_top;
  uint32_t top_key[kMaxTopLogprobs];
  int top_id[kMaxTopLogprobs];
};

// Adds (count 1, mass q) of every active lane to this block's bin `bin`, one shared atomic per
// distinct bin of the warp (logits crowd into few bins in the first passes, where per-lane
// atomics serialise).
__device__ void hist_add(Smem& s, bool active, uint32_t bin, bool by_mass, unsigned long long q) {
  const unsigned act = __ballot_sync(0xffffffffu, active);
  if (!act) return;
  const unsigned peers = __match_any_sync(0xffffffffu, active ? bin : 0xFFFFFFFFu);
  const int lane = threadIdx.x & 31;
  if (active && lane == __ffs(peers) - 1) atomicAdd(&s.cnt[bin], static_cast<uint32_t>(__popc(peers)));
  if (!by_mass) return;
  // q <= 2^32: split so that 32-lane sums fit in 32 bits.
  const unsigned lo = active ? static_cast<unsigned>(q & 0xFFFFu) : 0u;
  const unsigned hi = active ? static_cast<unsigned>(q >> 16) : 0u;
  unsigned todo = act;
  while (todo) {
    const int l = __ffs(todo) - 1;
    const unsigned g = __shfl_sync(0xffffffffu, peers, l);
    const bool mine = (g >> lane) & 1u;
    const unsigned ls = __reduce_add_sync(0xffffffffu, mine ? lo : 0u);
    const unsigned hs = __reduce_add_sync(0xffffffffu, mine ? hi : 0u);
    if (lane == l && (ls | hs)) atomicAdd(&s.mass[bin], (static_cast<unsigned long long>(hs) << 16) + ls);
    todo &= ~g;
  }
}

// Walks the row's bins (from the best) to the one where the running total reaches L.need; leaves
// its digit and the need left inside it. One thread of the leader.
__device__ void walk(Smem& L, bool by_mass, bool ascending) {
  unsigned long long cum = 0;
  for (int j = 0; j < 256; ++j) {
    const int b = ascending ? j : 255 - j;
    const unsigned long long w = by_mass ? L.row_mass[b] : L.row_cnt[b];
    if (w > 0 && cum + w >= L.need) {
      L.digit = b, L.need -= cum, L.tie_cnt = L.row_cnt[b], L.tie_mass = L.row_mass[b];
      return;
    }
    cum += w;
  }
  // Unreachable when need <= the total (the callers guarantee it); keep the last non-empty bin.
  for (int j = 255; j >= 0; --j) {
    const int b = ascending ? j : 255 - j;
    if (L.row_cnt[b]) {
      L.digit = b, L.need = 1, L.tie_cnt = L.row_cnt[b], L.tie_mass = L.row_mass[b];
      return;
    }
  }
}

// One histogram pass over the row: this block's tokens (i in its slices) for which `active(i, v)`
// gives a bin, summed into the leader's row histogram. Ends with the row histogram complete.
template <typename Bin>
__device__ void row_histogram(const float* p, int vocab, bool by_mass, float pmax, double inv_t, Smem& sm, Smem* L,
                              cg::cluster_group& cluster, Bin bin_of) {
  for (int b = threadIdx.x; b < 256; b += kThreads) {
    sm.cnt[b] = 0, sm.mass[b] = 0;
    if (cluster.block_rank() == 0) sm.row_cnt[b] = 0, sm.row_mass[b] = 0;
  }
  cluster.sync();  // the row histogram is clear before any block adds to it
  const int start = static_cast<int>(cluster.block_rank()) * kThreads;
  for (int base = start; base < vocab; base += kStride) {
    const int i = base + threadIdx.x;
    bool act = false;
    uint32_t bin = 0;
    unsigned long long q = 0;
    if (i < vocab) {
      const float v = p[i];
      act = bin_of(i, v, &bin);
      if (act && by_mass) q = sampling::mass_q32(v, pmax, inv_t);
    }
    hist_add(sm, act, bin, by_mass, q);
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
__device__ Cut radix_select(const float* p, int vocab, const Cut& outer, bool by_mass, float pmax, double inv_t,
                            unsigned long long need, float top_p, KeyId first, Smem& sm, Smem* L,
                            cg::cluster_group& cluster) {
  const bool lead = cluster.block_rank() == 0 && threadIdx.x == 0;
  uint32_t prefix = 0, mask = 0;
  for (int d = 3; d >= 0; --d) {
    const int shift = 8 * d;
    row_histogram(p, vocab, by_mass, pmax, inv_t, sm, L, cluster, [&](int i, float v, uint32_t* bin) {
      const uint32_t k = order_key(v);
      *bin = (k >> shift) & 255u;
      return (k & mask) == prefix && outer.inside(k, i);
    });
    if (lead) {
      L->done = 0;
      if (d == 3) {
        L->need = need;
        if (by_mass) {
          unsigned long long z = 0;
          for (int b = 0; b < 256; ++b) z += L->row_mass[b];
          L->need = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(z)));
          if (L->need == 0) L->done = 1;  // the first token alone reaches a zero target
        }
      }
      if (!L->done) walk(*L, by_mass, false);
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
    row_histogram(p, vocab, false, pmax, inv_t, sm, L, cluster, [&](int i, float v, uint32_t* bin) {
      *bin = (static_cast<uint32_t>(i) >> shift) & 255u;
      return order_key(v) == prefix && outer.inside(prefix, i) && (static_cast<uint32_t>(i) & id_mask) == id_prefix;
    });
    if (lead) {
      if (d == 2) L->need = take;
      walk(*L, false, true);
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

// Best Gumbel key (larger key, then lower id; id INT_MAX = none).
__device__ void best_merge(double& key, int& id, double ok, int oi) {
  if (oi != INT_MAX && (id == INT_MAX || ok > key || (ok == key && oi < id))) key = ok, id = oi;
}

__global__ void __launch_bounds__(256) process_kernel(ProcessParams p) {
  const int pr = blockIdx.y;
  const int r = p.processed_rows[pr];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  float* out = p.processed + static_cast<int64_t>(pr) * p.vocab;
  const bool restrict_rows = p.rows[r].restrict_to_allowed != 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.vocab; i += gridDim.x * blockDim.x)
    out[i] = restrict_rows ? -INFINITY : raw[i];
}

__global__ void __launch_bounds__(256) edit_kernel(ProcessParams p) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_edits) return;
  const int r = p.edit_rows[e];
  const DeviceSampleRow& row = p.rows[r];
  const LogitEdit ed = p.edits[e];
  if (row.restrict_to_allowed && !ed.allowed) return;
  const float raw = p.logits[static_cast<int64_t>(r) * p.ld + ed.token];
  p.processed[static_cast<int64_t>(row.processed) * p.vocab + ed.token] =
      sampling::apply_edit(raw, ed, row.presence, row.frequency, row.repetition);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  __shared__ Smem sm;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  Smem* L = cluster.map_shared_rank(&sm, 0);
  const int r = blockIdx.x / kCluster;
  const DeviceSampleRow row = p.params[r];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  const float* x = row.processed >= 0 ? p.processed + static_cast<int64_t>(row.processed) * p.vocab : raw;
  const int V = p.vocab;
  const int start = rank * kThreads + threadIdx.x;

  // Pass 1: the order's first token, the processed maximum, the raw log-sum-exp.
  KeyId first{0, kAllIds};
  float pmax = -INFINITY;
  Lse lse{-INFINITY, 0.0};
  for (int i = start; i < V; i += kStride) {
    const float v = x[i];
    first = better(first, KeyId{order_key(v), static_cast<uint32_t>(i)});
    if (v > pmax) pmax = v;
    const float w = raw[i];
    if (w > -INFINITY) {
      if (w > lse.m) {
        lse.s = (lse.m == -INFINITY ? 0.0 : lse.s * static_cast<double>(expf(lse.m - w))) + 1.0;
        lse.m = w;
      } else {
        lse.s += static_cast<double>(expf(w - lse.m));
      }
    }
  }
  first = block_best(first, sm);
  pmax = block_reduce(pmax, sm.red_f, [](float a, float b) { return fmaxf(a, b); });
  lse = block_lse(lse, sm);
  if (threadIdx.x == 0) L->part_first[rank] = first, L->part_pmax[rank] = pmax, L->part_lse[rank] = lse;
  cluster.sync();
  first = L->part_first[0], pmax = L->part_pmax[0], lse = L->part_lse[0];
  for (int b = 1; b < kCluster; ++b) {  // fixed order: every block gets the same result
    first = better(first, L->part_first[b]);
    pmax = fmaxf(pmax, L->part_pmax[b]);
    lse = lse_merge(lse, L->part_lse[b]);
  }
  const double log_z = static_cast<double>(lse.m) + log(lse.s);

  int token = static_cast<int>(first.id);
  if (row.temperature > 0.0f) {
    const double inv_t = 1.0 / static_cast<double>(row.temperature);
    Cut cut_k, cut_p;
    if (row.top_k > 0 && row.top_k < V)
      cut_k = radix_select(x, V, Cut{}, false, pmax, inv_t, static_cast<unsigned long long>(row.top_k), -1.0f, first,
                           sm, L, cluster);
    if (row.top_p < 1.0f) cut_p = radix_select(x, V, cut_k, true, pmax, inv_t, 0, row.top_p, first, sm, L, cluster);
    // Gumbel-max over the kept, finite tokens.
    const double min_q = static_cast<double>(row.min_p) * 4294967296.0;
    double best_key = -DBL_MAX;
    int best = INT_MAX;
    for (int i = start; i < V; i += kStride) {
      const float v = x[i];
      if (!isfinite(v)) continue;
      const uint32_t k = order_key(v);
      if (!cut_k.inside(k, i) || !cut_p.inside(k, i)) continue;
      if (row.min_p > 0.0f && static_cast<double>(sampling::mass_q32(v, pmax, inv_t)) < min_q) continue;
      const double g = sampling::gumbel_key(v, inv_t, row.seed, row.step, static_cast<uint32_t>(i));
      best_merge(best_key, best, g, i);
    }
    for (int o = 16; o > 0; o >>= 1)
      best_merge(best_key, best, __shfl_xor_sync(0xffffffffu, best_key, o), __shfl_xor_sync(0xffffffffu, best, o));
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
    for (int b = 1; b < kCluster; ++b) best_merge(best_key, best, L->part_key[b], L->part_best[b]);
    if (best != INT_MAX) token = best;
  }

  DeviceSampleResult* out = p.out + r;
  const int n = min(row.logprobs, min(V, kMaxTopLogprobs));
  if (n > 0) {
    // Count mode never takes radix_select's zero-target exit, so its `first` argument is unused.
    const Cut cut = radix_select(raw, V, Cut{}, false, 0.0f, 1.0, static_cast<unsigned long long>(n), -1.0f,
                                 KeyId{0, kAllIds}, sm, L, cluster);
    if (rank == 0 && threadIdx.x == 0) L->n_top = 0;
    cluster.sync();
    for (int i = start; i < V; i += kStride) {
      const uint32_t k = order_key(raw[i]);
      if (cut.inside(k, i)) {
        const int slot = atomicAdd(&L->n_top, 1);
        if (slot < kMaxTopLogprobs) L->top_key[slot] = k, L->top_id[slot] = i;
      }
    }
    cluster.sync();
    if (rank == 0 && threadIdx.x == 0) {
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
    out->logprob = static_cast<float>(static_cast<double>(raw[token]) - log_z);
  }
  cluster.sync();  // no block leaves while another may still read or write its shared memory
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

void launch_sample(const SampleParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  MOELORA_CHECK(p.vocab > 0 && p.vocab < (1 << 24) && p.out != nullptr && p.params != nullptr);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.rows * kCluster);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_kernel, p));
  MOELORA_CUDA_CHECK_LAUNCH();
}

}  // namespace moelora::cuda
