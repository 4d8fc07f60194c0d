// The sampler's exact fallback (sample_kernel.cu): radix selection on the order key, 8 bits a pass,
// for the selections the binned histogram cannot narrow to kMaxCandidates tokens (thousands of
// tokens tied at one value) and for the top logprobs. Counts or fixed-point masses in shared
// memory, exact integer sums, so the boundary is the reference's. Device code for sample_kernel.cu.
#pragma once

#include "backends/cuda/kernels/sample_internal.cuh"

namespace moelora::cuda::sample_detail {

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
    if (active && q) shared_add_u64(&s.mass[bin], q);
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
    if (lane == l && (ls | hs)) shared_add_u64(&s.mass[bin], (static_cast<unsigned long long>(hs) << 16) + ls);
    todo &= ~g;
  }
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
// false) or fixed-point mass (true) reaches `need` (1 <= need <= their total). With exact_id the
// cut's id is resolved even when every token tied at its key is taken, so that c.id is the
// boundary token itself (the sampled token); without, such a cut holds every id of its key.
template <int C>
__device__ Cut radix_select(const float* p, int vocab, const Cut& outer, bool by_mass, float pmax, double inv_t,
                            unsigned long long need, bool exact_id, Smem& sm, Smem* L, cg::cluster_group& cluster) {
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
      if (d == 3 && lane == 0) L->need = need;
      __syncwarp();
      walk(*L, by_mass, false);
      clear_row_histogram(*L);
    }
    cluster.sync();
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
  if (take >= tie_cnt) {
    if (!exact_id) return c;  // c.id = every id
    take = tie_cnt;           // the last of the tied tokens
  }
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
}  // namespace moelora::cuda::sample_detail
