// The sampling kernel (sampling.cuh: launch_sample): Backend::sample's steps 2-4 (ops/backend.h) for
// rows of f32 logits. One thread-block cluster of C blocks per row (C = 2, 4, 8 or 16, chosen by the
// backend through cuda_plan::choose_sample_cluster): each block takes every C-th 512-wide slice of
// the vocabulary, and the row's reductions and histograms are combined in the leader block's shared
// memory (distributed shared memory). The passes over a row:
//  1. the order's first token, the largest and smallest finite processed values, the raw
//     log-sum-exp;
//  2. (temperature > 0) every token's exact fixed-point mass into the row's binned histogram
//     (sample_bins.cuh), with the row's total mass and the count min_p keeps;
//  3. each cut (top-k by count, top-p by mass, min-p by count) and then the draw (the first token
//     whose cumulative mass exceeds a uniform integer below the kept mass: the inverse CDF) is a
//     position in the order: the histogram's walk names its bin, one pass collects that bin's
//     tokens (a few hundred) and the leader sorts them. A bin of more than kMaxCandidates tokens is
//     split once more (a sub-bin pass); one still too full (thousands of tokens tied at one value)
//     is resolved by radix selection (sample_radix.cuh);
//  4. top logprobs: radix selection of the raw row.
// Every decision is an exact integer sum or comparison, so the token is the reference's (up to a
// device exp ulp at a rounding boundary, docs/numerics.md) and the bytes are the same for every C:
// the one floating-point reduction, the raw log-sum-exp, is always taken over the same fixed
// partition of the vocabulary (kThreads * kMaxCluster lanes, reduced in one fixed tree).
// The kernel is held to 64 registers so that two blocks share an SM (measured: at 123 registers
// 256 rows took 4.0 ms instead of 3.2 with the radix-only kernel before this one).
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/kernels/sample_bins.cuh"
#include "backends/cuda/kernels/sample_internal.cuh"
#include "backends/cuda/kernels/sample_radix.cuh"

namespace moelora::cuda {
namespace {

using namespace sample_detail;

// A position found by radix selection (the bins could not narrow it): the cut, then one pass for
// the count and mass of the prefix it ends.
template <int C>
__device__ __noinline__ Position locate_by_radix(const float* x, int V, float top, double inv_t, bool by_mass,
                                    unsigned long long need, Smem& sm, Smem* L, cg::cluster_group& cluster) {
  const Cut c = radix_select<C>(x, V, Cut{}, by_mass, top, inv_t, need, /*exact_id=*/true, sm, L, cluster);
  const int rank = static_cast<int>(cluster.block_rank());
  unsigned long long n = 0, m = 0;
  for_row<C>(x, V, rank, [&](int, int i, float v, bool in_range) {
    if (in_range && c.inside(order_key(v), static_cast<uint32_t>(i))) ++n, m += sampling::mass_q32(v, top, inv_t);
  });
  n = block_reduce(n, sm.scan_a, [](unsigned long long a, unsigned long long b) { return a + b; });
  m = block_reduce(m, sm.scan_b, [](unsigned long long a, unsigned long long b) { return a + b; });
  if (threadIdx.x == 0) L->part_n[rank] = n, L->part_m[rank] = m;
  cluster.sync();
  n = 0, m = 0;
  for (int b = 0; b < C; ++b) n += L->part_n[b], m += L->part_m[b];
  return Position{c.key, c.id, n, m};
}

// Not inlined (nor locate_by_radix): inlined at its four call sites it took the kernel from 172 to
// 912 bytes of spills per thread at the 64-register cap (ptxas -v).
// The position in the order where the cumulative count (by_mass false) or mass of the row's tokens
// first reaches `need` (1 <= need <= the total), from the row's binned histogram (sm.l1_* of the
// leader, complete). Called by every thread of the cluster.
template <int C>
__device__ __noinline__ Position locate(const float* x, int V, const BinMap& map, double inv_t, bool by_mass,
                           unsigned long long need, Smem& sm, Smem* L, cg::cluster_group& cluster) {
  const int rank = static_cast<int>(cluster.block_rank());
  const bool leader = rank == 0;
  if (leader) walk_bins(sm.l1_cnt, sm.l1_mass, by_mass, need, sm);
  cluster.sync();
  const BinPick pick = L->pick;
  unsigned long long base_n = pick.cnt_before, base_m = pick.mass_before;
  bool fallback = pick.bin >= kBins;
  uint32_t sub = kBins;  // none: every token of the bin
  if (!fallback && pick.cnt > kMaxCandidates) {
    if (pick.bin == kBins - 1) {
      fallback = true;
    } else {
      // The bin's tokens by sub-bin, in this block's histogram, then in the leader's row_*.
      clear_bins(sm.cnt, sm.mass);
      __syncthreads();
      for_row<C>(x, V, rank, [&](int, int, float v, bool in_range) {
        const bool act = in_range && map.bin(v) == pick.bin;
        uint32_t s = 0;
        unsigned long long q = 0;
        if (act) s = map.sub_bin(v, pick.bin), q = sampling::mass_q32(v, map.top, inv_t);
        bin_add(sm.cnt, sm.mass, act, s, q);
      });
      __syncthreads();
      merge_bins(sm, L->row_cnt, L->row_mass);
      cluster.sync();
      if (leader) {
        walk_bins(sm.row_cnt, sm.row_mass, by_mass, need - (by_mass ? base_m : base_n), sm);
        clear_bins(sm.row_cnt, sm.row_mass);  // walk_bins ended with a barrier: every bin was read
      }
      cluster.sync();
      const BinPick p2 = L->pick;
      if (p2.bin >= kBins || p2.cnt > kMaxCandidates) fallback = true;
      else sub = p2.bin, base_n += p2.cnt_before, base_m += p2.mass_before;
    }
  }
  if (fallback) return locate_by_radix<C>(x, V, map.top, inv_t, by_mass, need, sm, L, cluster);
  // The bin's (or sub-bin's) tokens into the leader's candidates: their count is the histogram's,
  // at most kMaxCandidates.
  const int lane = threadIdx.x & 31;
  for_row<C>(x, V, rank, [&](int, int i, float v, bool in_range) {
    const bool take = in_range && map.bin(v) == pick.bin && (sub == kBins || map.sub_bin(v, pick.bin) == sub);
    const unsigned m = __ballot_sync(kFull, take);
    if (!m) return;
    const int lead = __ffs(m) - 1;
    int base = 0;
    if (lane == lead) base = atomicAdd(&L->n_cand, __popc(m));
    base = __shfl_sync(kFull, base, lead);
    if (take)
      L->cand[base + __popc(m & ((1u << lane) - 1u))] =
          (static_cast<unsigned long long>(order_key(v)) << 32) | ~static_cast<uint32_t>(i);
  });
  cluster.sync();
  if (leader) {
    resolve_candidates(sm, by_mass, need, base_n, base_m, map.top, inv_t);
    if (threadIdx.x == 0) sm.n_cand = 0;  // resolve_candidates ended with a barrier
  }
  cluster.sync();
  return L->pos;
}

template <int C>
__global__ void __launch_bounds__(kThreads, 2) sample_kernel(SampleParams p) {  // 2 blocks/SM: <= 64 registers
  constexpr int kVirtual = kMaxCluster / C;  // log-sum-exp virtual blocks held by each block
  static_assert(C >= kMinCluster, "more virtual blocks than part_own holds");
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_bytes);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  Smem* L = cluster.map_shared_rank(&sm, 0);
  const int r = blockIdx.x / C;
  // Read where used (not held in registers through the kernel: it is held to 64 of them).
  const DeviceSampleRow& row = p.params[r];
  const float* raw = p.logits + static_cast<int64_t>(r) * p.ld;
  const float* x = row.processed >= 0 ? p.processed + static_cast<int64_t>(row.processed) * p.vocab : raw;
  const int V = p.vocab;
  if (rank == 0) {  // published by the cluster barrier after pass 1, before any block adds to them
    clear_bins(sm.l1_cnt, sm.l1_mass);
    clear_bins(sm.row_cnt, sm.row_mass);
    if (threadIdx.x == 0) sm.n_cand = 0, sm.z_all = 0, sm.n_minp = 0;
  }
  // Distributed shared memory may only be touched once every block of the cluster runs: arrive
  // now, wait just before pass 1 writes its parts into the leader.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // Pass 1: the order's first token, the largest and smallest finite processed values, and the raw
  // log-sum-exp, summed per virtual block: this block holds the virtual blocks rank + a * C
  // (a < kVirtual), and thread t of virtual block b owns the tokens i = b * kThreads + t + m *
  // kThreads * kMaxCluster. One sweep per virtual block (a single accumulator in registers, not
  // kVirtual of them), each lane summing its tokens in increasing i as the partition prescribes.
  KeyId first{0, kAllIds};
  float pmax = -INFINITY, vmin = INFINITY;
  const bool processed = x != raw;
  for (int a = 0; a < kVirtual; ++a) {
    constexpr int vstride = kThreads * kMaxCluster;
    Lse acc{-INFINITY, 0.0};
    for (int i0 = (rank + a * C) * kThreads + static_cast<int>(threadIdx.x); i0 < V; i0 += vstride * kUnroll) {
      float wv[kUnroll];
      load_slice(raw, i0, vstride, V, wv);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * vstride;
        if (i >= V) break;
        const float w = wv[u];
        const float v = processed ? x[i] : w;
        first = better(first, KeyId{order_key(v), static_cast<uint32_t>(i)});
        if (v > pmax && v < INFINITY) pmax = v;
        if (v < vmin && v > -INFINITY) vmin = v;
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
  vmin = block_reduce(vmin, sm.red_f, [](float a, float b) { return fminf(a, b); });
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  if (threadIdx.x == 0)
    for (int a = 0; a < kVirtual; ++a) L->part_lse[rank + a * C] = sm.part_own[a];
  if (threadIdx.x == 0) L->part_first[rank] = first, L->part_pmax[rank] = pmax, L->part_vmin[rank] = vmin;
  cluster.sync();
  first = L->part_first[0], pmax = L->part_pmax[0], vmin = L->part_vmin[0];
  for (int b = 1; b < C; ++b)
    first = better(first, L->part_first[b]), pmax = fmaxf(pmax, L->part_pmax[b]), vmin = fminf(vmin, L->part_vmin[b]);
  // The row's log-sum-exp is taken from the parts at the end, by the one thread that writes the
  // results (the leader's parts stay in place).
  const auto row_log_z = [&] {
    Lse row_lse = L->part_lse[0];
    for (int b = 1; b < kMaxCluster; ++b) row_lse = lse_merge(row_lse, L->part_lse[b]);  // fixed order
    return static_cast<double>(row_lse.m) + log(row_lse.s);
  };

  int token = static_cast<int>(first.id);
  if (row.temperature > 0.0f && pmax > -INFINITY) {  // else greedy, or no finite token: the first
    const double inv_t = 1.0 / static_cast<double>(row.temperature);
    const float inv_t_f = static_cast<float>(inv_t);
    const BinMap map = make_bin_map(pmax, vmin, row.temperature);
    // min_p keeps q_i >= min_p * 2^32 (an exact double), i.e. q_i >= its ceiling (>= 1).
    unsigned long long min_q = 0;
    if (row.min_p > 0.0f) {
      const double mq = ceil(static_cast<double>(row.min_p) * 4294967296.0);
      min_q = mq >= 1.8e19 ? ~0ull : static_cast<unsigned long long>(mq);
    }
    // Pass 2: the binned histogram, the row's mass, and how many tokens min_p keeps (a prefix of
    // the order: +inf, then the finite tokens down to the last whose mass reaches min_q).
    clear_bins(sm.cnt, sm.mass);
    __syncthreads();
    unsigned long long z = 0, kept_by_min_p = 0;
    for_row<C>(x, V, rank, [&](int, int, float v, bool in_range) {
      uint32_t bin = 0;
      unsigned long long q = 0;
      if (in_range) {
        bin = map.bin(v), q = token_mass(v, pmax, inv_t, inv_t_f);
        z += q;
        kept_by_min_p += (v == INFINITY || (min_q && q >= min_q)) ? 1 : 0;
      }
      bin_add(sm.cnt, sm.mass, in_range, bin, q);
    });
    const auto plus = [](unsigned long long a, unsigned long long b) { return a + b; };
    z = block_reduce(z, sm.scan_a, plus);
    kept_by_min_p = block_reduce(kept_by_min_p, sm.scan_b, plus);
    merge_bins(sm, L->l1_cnt, L->l1_mass);
    if (threadIdx.x == 0) atomicAdd(&L->z_all, z), atomicAdd(&L->n_minp, kept_by_min_p);
    cluster.sync();
    // The kept prefix of the order: n_keep tokens of mass m_keep.
    unsigned long long n_keep = static_cast<unsigned long long>(V), m_keep = L->z_all;
    if (row.top_k > 0 && row.top_k < V) {
      n_keep = static_cast<unsigned long long>(row.top_k);
      m_keep = locate<C>(x, V, map, inv_t, false, n_keep, sm, L, cluster).mass;
    }
    if (row.top_p < 1.0f) {
      const double need = ceil(static_cast<double>(row.top_p) * static_cast<double>(m_keep));
      if (need <= 0.0) {  // the first token alone reaches a zero target
        n_keep = 1, m_keep = sampling::mass_q32(sampling::key_value(first.key), pmax, inv_t);
      } else {
        const Position cut = locate<C>(x, V, map, inv_t, true, static_cast<unsigned long long>(need), sm, L, cluster);
        n_keep = cut.n, m_keep = cut.mass;
      }
    }
    if (row.min_p > 0.0f && L->n_minp < n_keep) {
      n_keep = L->n_minp;
      m_keep = n_keep ? locate<C>(x, V, map, inv_t, false, n_keep, sm, L, cluster).mass : 0;
    }
    if (m_keep > 0) {
      const unsigned long long t = sampling::draw_target(sampling::draw_bits(row.seed, row.step), m_keep);
      const uint32_t id = locate<C>(x, V, map, inv_t, true, t + 1, sm, L, cluster).id;
      if (id < static_cast<uint32_t>(V)) token = static_cast<int>(id);  // always (t + 1 <= the kept mass)
    }
  }

  DeviceSampleResult* out = p.out + r;
  const int n = min(row.logprobs, min(V, kMaxTopLogprobs));
  if (n > 0) {
    const Cut cut = radix_select<C>(raw, V, Cut{}, false, 0.0f, 1.0, static_cast<unsigned long long>(n),
                                    /*exact_id=*/false, sm, L, cluster);
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
  cfg.dynamicSmemBytes = sizeof(Smem);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // Per device context, so with each launch (a cheap host call; the sampler runs outside graphs).
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(sample_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(sizeof(Smem))));
  if (C > 8) {  // beyond the portable 8: opt in
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
