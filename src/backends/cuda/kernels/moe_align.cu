// One-CTA counting sort of (token, k) pairs into GEMM tiles and LoRA groups (see moe_align.cuh).
#include <algorithm>
#include <mutex>

#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/router_device.cuh"

namespace moelora::cuda {

namespace {

constexpr int kAlignThreads = 1024;
constexpr size_t kAlignMaxSmem = 200 * 1024;

using moe_detail::block_exclusive_scan;

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Scans `n` buckets: off[b] = exclusive prefix of cnt, t1[b] / t2[b] = exclusive prefixes of
// tiles1(b) / tiles2(b). Returns totals. Each thread scans a contiguous run of buckets.
template <bool kThird = true, typename F1, typename F2>
__device__ void scan_buckets(int n, const int* cnt, int* off, int* t1, int* t2, F1 tiles1, F2 tiles2, int* scratch,
                             int* tot_c, int* tot_1, int* tot_2) {
  const int per = ceil_div(n, blockDim.x);
  const int b0 = min(n, static_cast<int>(threadIdx.x) * per), b1 = min(n, b0 + per);
  int lc = 0, l1 = 0, l2 = 0;
  for (int b = b0; b < b1; ++b) {
    lc += cnt[b];
    l1 += tiles1(b, cnt[b]);
    l2 += tiles2(b, cnt[b]);
  }
  int pc = block_exclusive_scan(lc, scratch, tot_c);
  int p1 = block_exclusive_scan(l1, scratch, tot_1);
  int p2 = 0;
  *tot_2 = 0;
  if (kThird) p2 = block_exclusive_scan(l2, scratch, tot_2);
  for (int b = b0; b < b1; ++b) {
    off[b] = pc;
    t1[b] = p1;
    if (t2) t2[b] = p2;
    pc += cnt[b];
    p1 += tiles1(b, cnt[b]);
    p2 += tiles2(b, cnt[b]);
  }
}

__device__ void align_base(const MoeAlignParams& p, int* smem, int* scratch) {
  const int E = p.E, P = p.T * p.k, BT = p.tile_rows;
  int* cnt = smem;
  int* off = cnt + E;
  int* toff = off + E;
  int* cursor = toff + E;
  for (int b = threadIdx.x; b < E; b += blockDim.x) cnt[b] = cursor[b] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const int e = p.ids[i];
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  int tot_c, tot_t, unused;
  scan_buckets<false>(
      E, cnt, off, toff, nullptr, [&](int, int n) { return ceil_div(n, BT); }, [](int, int) { return 0; }, scratch,
      &tot_c, &tot_t, &unused);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int n = cnt[e];
    for (int i = 0; i * BT < n; ++i) {
      const int ti = toff[e] + i;
      const int c = min(BT, n - i * BT);
      if (ti >= p.max_tiles) break;
      p.tiles[ti] = MoeTile{e, off[e] + i * BT, c, 0};
      for (int m = c; m < BT; ++m) p.tile_pairs[ti * BT + m] = -1;  // padding of a partial tile
    }
  }
  // Scatter: the r-th pair of expert e lands at sorted[off[e] + r] and in row r % BT of the
  // expert's tile r / BT.
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const int e = p.ids[i];
    if (e < 0 || e >= E) continue;
    const int r = atomicAdd(&cursor[e], 1);
    p.sorted[off[e] + r] = i;
    const int ti = toff[e] + r / BT;
    if (ti < p.max_tiles) p.tile_pairs[ti * BT + r % BT] = i;
  }
  if (threadIdx.x == 0) p.counters[kMoeCntTiles] = min(tot_t, p.max_tiles);
}

// LoRA grouping. Pair buckets: s * E + e for valid (slot, expert) with a non-zero rank on either
// half, NB - 1 = "none". Token buckets: slots whose gate_up A is shared by all experts, so the
// gate_up shrink runs once per token instead of once per (token, k) pair.
__device__ void align_lora(const MoeAlignParams& p, int* smem, int* scratch) {
  const int E = p.E, S = p.num_slots, P = p.T * p.k, LT = kMoeLoraTileRows;
  const int NB = S * E + 1;
  int* cnt = smem;
  int* off = cnt + NB;
  int* ltoff = off + NB;
  int* gtoff = ltoff + NB;
  int* tcnt = gtoff + NB;
  int* toff = tcnt + S;
  int* ttoff = toff + S;
  // What each slot's ranks and A layout make of its pairs, read once from the tables into shared
  // memory. ncu (H100, 2026-12-05) measured this kernel 13 us slower with LoRA than without at 1
  // and at 64 tokens; the bucket lambdas below read the rank tables from global memory for every
  // bucket, the likely cause (this form is not yet timed).
  constexpr int kHasLora = 1, kTokenShrink = 2, kPairShrink = 4;
  int* slot_kind = ttoff + S;
  auto pair_bucket = [&](int i) {
    const int s = p.token_slot[i / p.k], e = p.ids[i];
    const bool ok = s >= 0 && s < S && e >= 0 && e < E && (slot_kind[s] & kHasLora);
    return ok ? s * E + e : NB - 1;
  };
  auto token_bucket = [&](int t) {
    const int s = p.token_slot[t];
    return (s >= 0 && s < S && (slot_kind[s] & kTokenShrink)) ? s : -1;
  };
  // A pair bucket feeds the gate_up shrink when its slot has a gate_up rank and per-expert A.
  auto g_pair = [&](int b) { return b < NB - 1 && (slot_kind[b / E] & kPairShrink) != 0; };
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const bool gu = p.gu_rank[s] > 0, shared_a = p.gu_a_stride[s] == 0;
    slot_kind[s] = (gu || p.d_rank[s] > 0 ? kHasLora : 0) | (gu && shared_a ? kTokenShrink : 0) |
                   (gu && !shared_a ? kPairShrink : 0);
  }
  for (int b = threadIdx.x; b < NB; b += blockDim.x) cnt[b] = 0;
  for (int s = threadIdx.x; s < S; s += blockDim.x) tcnt[s] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[pair_bucket(i)], 1);
  for (int t = threadIdx.x; t < p.T; t += blockDim.x) {
    const int s = token_bucket(t);
    if (s >= 0) atomicAdd(&tcnt[s], 1);
  }
  __syncthreads();
  int tot_c, tot_l, tot_g;
  scan_buckets(
      NB, cnt, off, ltoff, gtoff, [&](int, int n) { return ceil_div(n, LT); },
      [&](int b, int n) { return g_pair(b) ? ceil_div(n, LT) : 0; }, scratch, &tot_c, &tot_l, &tot_g);
  int ttot_c, ttot_t, unused;
  scan_buckets<false>(
      S, tcnt, toff, ttoff, nullptr, [&](int, int n) { return ceil_div(n, LT); }, [](int, int) { return 0; },
      scratch, &ttot_c, &ttot_t, &unused);
  __syncthreads();
  for (int b = threadIdx.x; b < NB; b += blockDim.x) {
    const int n = cnt[b];
    const bool none = b == NB - 1;
    const int s = none ? -1 : b / E, e = none ? -1 : b % E;
    const bool g = g_pair(b);
    for (int i = 0; i * LT < n; ++i) {
      const MoeTile tile{e, off[b] + i * LT, min(LT, n - i * LT), s};
      if (ltoff[b] + i < p.max_l_tiles) p.l_tiles[ltoff[b] + i] = tile;
      if (g && gtoff[b] + i < p.max_g_tiles) p.g_tiles[gtoff[b] + i] = tile;
    }
  }
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int n = tcnt[s];
    for (int i = 0; i * LT < n; ++i) {
      const int gi = tot_g + ttoff[s] + i;
      if (gi < p.max_g_tiles) p.g_tiles[gi] = MoeTile{-1, toff[s] + i * LT, min(LT, n - i * LT), s};
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) p.l_sorted[atomicAdd(&off[pair_bucket(i)], 1)] = i;
  for (int t = threadIdx.x; t < p.T; t += blockDim.x) {
    const int s = token_bucket(t);
    if (s >= 0) p.t_sorted[atomicAdd(&toff[s], 1)] = t;
  }
  if (threadIdx.x == 0) {
    p.counters[kMoeCntLoraTiles] = min(tot_l, p.max_l_tiles);
    p.counters[kMoeCntLoraGuTiles] = min(tot_g + ttot_t, p.max_g_tiles);
  }
}

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(const __grid_constant__ MoeAlignParams p) {
  extern __shared__ __align__(16) int align_smem[];
  __shared__ int scratch[33];
  pdl_wait();
  pdl_trigger();
  if (p.route.logits) {
    moe_detail::route_tokens_block<256>(p.route, 0, blockDim.x / 32, reinterpret_cast<double*>(align_smem));
    __syncthreads();  // ids written by this block are visible to it after the barrier
  }
  if (p.tiles) align_base(p, align_smem, scratch);
  if (p.token_slot) {
    __syncthreads();
    align_lora(p, align_smem, scratch);
  }
}

// A plain function, not a lambda (see moe_gemm.cu: nvcc compiles constexpr lambdas for the device).
void set_align_smem_limit() {
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(moe_align_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kAlignMaxSmem)));
}

size_t align_smem_bytes(const MoeAlignParams& p, int threads) {
  size_t b = 0;
  if (p.route.logits && p.route.mode == RouterMode::kSigmoidGrouped)
    b = std::max(b, sizeof(double) * (threads / 32) * p.E);
  if (p.tiles) b = std::max(b, sizeof(int) * 4 * p.E);
  if (p.token_slot) b = std::max(b, sizeof(int) * (4 * (size_t(p.num_slots) * p.E + 1) + 4 * p.num_slots));
  return b;
}

}  // namespace

void moe_align(const MoeAlignParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.T >= 0 && p.k >= 1 && p.E >= 1 && p.counters);
  MOELORA_CHECK(p.tiles || p.token_slot);
  if (p.tiles)
    MOELORA_CHECK(p.sorted && p.tile_pairs && p.tile_rows >= 1 &&
                  p.max_tiles >= moe_max_tiles(p.T * p.k, p.E, p.tile_rows));
  if (p.token_slot) {
    const int nb = p.num_slots * p.E + 1;
    MOELORA_CHECK(nb <= kMoeMaxLoraBuckets);
    MOELORA_CHECK(p.gu_rank && p.d_rank && p.gu_a_stride && p.l_sorted && p.l_tiles && p.t_sorted && p.g_tiles);
    MOELORA_CHECK(p.max_l_tiles >= moe_max_tiles(p.T * p.k, nb, kMoeLoraTileRows));
    MOELORA_CHECK(p.max_g_tiles >= p.max_l_tiles + moe_max_tiles(p.T, p.num_slots, kMoeLoraTileRows));
  }
  if (p.route.logits) {
    MOELORA_CHECK(p.route.ids == p.ids && p.route.T == p.T && p.route.k == p.k && p.route.E == p.E);
    MOELORA_CHECK(p.E <= 256 && p.k <= 32);  // fused routing compiles register arrays for E <= 256
  }
  if (p.T == 0) {
    // Nothing to route; the counters still describe an empty batch so graph-free callers that
    // launch the GEMMs anyway see zero work.
    MOELORA_CUDA_CHECK(cudaMemsetAsync(p.counters, 0, sizeof(int32_t) * kMoeNumCounters, stream));
    return;
  }
  static std::once_flag once;
  std::call_once(once, set_align_smem_limit);
  // Few pairs: a quarter of the threads (fewer warps to wait for at each barrier); fused routing
  // beyond 8 tokens wants all 32 warps (one token per warp).
  const bool small = p.T * p.k <= 512 && (!p.route.logits || p.T <= 8) &&
                     size_t(p.num_slots) * p.E + 1 <= 2048;
  const int threads = small ? kAlignThreads / 4 : kAlignThreads;
  const size_t smem = align_smem_bytes(p, threads);
  MOELORA_CHECK(smem <= kAlignMaxSmem);
  moe_launch(moe_align_kernel, dim3(1), dim3(threads), smem, stream, p.pdl, p);
}

}  // namespace moelora::cuda
