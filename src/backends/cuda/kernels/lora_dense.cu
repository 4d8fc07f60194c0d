// Multi-adapter dense LoRA (see lora_dense.cuh): the fused segmented kernel, its host planner and
// the single-adapter cuBLAS path.
//
// Segmented kernel, one thread-block cluster of `cluster` blocks per work item (projection p,
// slot s, <= 32 tokens):
//  1. shrink: block b of the cluster takes the 128-wide K blocks b, b + cluster, ...; its warps
//     compute u = A_s x on the tensor cores (A_s rows are the MMA's A operand, tokens its B
//     operand, the same lane-owns-a-32-element-run layout as dense_gemm.cu) and leave the block's
//     partial u [rank][tokens] (f32) in shared memory;
//  2. cluster barrier; every block sums the partials of all blocks (distributed shared memory,
//     fixed order) into the full u, split into bf16 hi + lo parts so that the expand's MMA keeps
//     ~16 bits of u (the rounding that remains is the one of y itself);
//  3. expand: block b takes a contiguous slice of `out`, y[t] += B_s u[t] with B_s rows as the A
//     operand and u as B, then a read-modify-write of y (each element owned by one thread);
//  4. cluster barrier, so that no block leaves while another still reads its shared memory.
// Latency, not bandwidth, decides this kernel at decode sizes: B_s and y do not depend on u, so the
// block's slice of B_s is copied into shared memory with cp.async as the kernel starts (it lands
// while the shrink and the cluster exchange run) and y is read one tile ahead of its update.
#include <cooperative_groups.h>

#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/lora_dense.cuh"

namespace cg = cooperative_groups;

namespace moelora::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTok = kLoraTokensPerItem;
constexpr int kPS = 40;    // f32 row stride of the [rank][token] tiles: float2 stores without bank conflicts
constexpr int kLDU = 144;  // bf16 row stride of the [token][rank] tiles: 8-byte MMA loads without conflicts
constexpr int kMetaHeader = 4;

struct ProblemDev {
  const bf16* x;
  int64_t ld_x;
  bf16* y;
  int64_t ld_y;
  int in, out;
  const int64_t* a_ptrs;
  const int64_t* b_ptrs;
  const int32_t* ranks;
};

struct KernelParams {
  ProblemDev prob[kLoraMaxProblems];
  const int32_t* meta;
  int cluster;
  int b_smem_bytes;  // dynamic shared memory for the prefetched slice of B_s
};

constexpr int kMaxBSmem = 64 * 1024;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// B[n][k0..k0+3] from the shared-memory copy of rows [0, nb) of the slice (row stride = rank).
__device__ __forceinline__ uint2 load_b_quad_smem(const bf16* sb, int nl, int k0, int rank) {
  if (k0 >= rank) return make_uint2(0u, 0u);
  const bf16* row = sb + nl * rank + k0;
  if (rank % 4 == 0) return *reinterpret_cast<const uint2*>(row);
  const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
  uint32_t e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = k0 + i < rank ? r[i] : 0u;
  return make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
}

constexpr int kPartBytes = kWarps * 16 * kPS * 4;          // [groups][rank tile rows][kPS] f32
constexpr int kUBytes = 2 * kTok * kLDU * 2;               // hi and lo [token][kLDU] bf16
constexpr int kScratchBytes = kPartBytes > kUBytes ? kPartBytes : kUBytes;

// Four consecutive elements B[n][k0..k0+3] (zero past the rank or past `out`) as two bf16x2.
__device__ __forceinline__ uint2 load_b_quad(const bf16* B, int n, bool n_ok, int k0, int rank, bool vec) {
  if (!n_ok || k0 >= rank) return make_uint2(0u, 0u);
  const bf16* row = B + static_cast<int64_t>(n) * rank + k0;
  if (vec) return __ldg(reinterpret_cast<const uint2*>(row));
  const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
  uint32_t e[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = k0 + i < rank ? __ldg(r + i) : 0u;
  return make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
}

__global__ void __launch_bounds__(kThreads) lora_segmented_kernel(const __grid_constant__ KernelParams kp) {
  extern __shared__ __align__(16) unsigned char s_dyn[];  // the prefetched slice of B_s
  __shared__ __align__(16) float s_my_u[kLoraMaxRank * kPS];
  __shared__ __align__(16) unsigned char s_scratch[kScratchBytes];
  __shared__ int s_tok[kTok];

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = kp.cluster;
  const int item = blockIdx.x / cs;
  const int crank = static_cast<int>(cluster.block_rank());
  const int32_t* meta = kp.meta;
  // Everything up to the first cluster barrier exits uniformly for the whole cluster.
  if (item >= meta[0]) return;
  const int capacity = meta[1];
  const int32_t* it = meta + kMetaHeader + 4 * item;
  const int p = it[0], slot = it[1], first = it[2], count = it[3];
  const ProblemDev& P = kp.prob[p];
  const int rank = min(static_cast<int>(P.ranks[slot]), kLoraMaxRank);
  if (rank <= 0) return;
  const bf16* A = reinterpret_cast<const bf16*>(P.a_ptrs[slot]);
  const bf16* B = reinterpret_cast<const bf16*>(P.b_ptrs[slot]);
  // This block's slice of out and as many of its B_s rows as the shared buffer holds, requested
  // now: nothing below waits for them until the expand.
  const int otiles = ceil_div(P.out, 16);
  const int ot0 = static_cast<int>(static_cast<int64_t>(otiles) * crank / cs);
  const int ot1 = static_cast<int>(static_cast<int64_t>(otiles) * (crank + 1) / cs);
  const int n_begin = ot0 * 16;
  const int slice_rows = max(0, min(ot1 * 16, P.out) - n_begin);
  const bool b_aligned = (reinterpret_cast<uintptr_t>(B) & 15u) == 0;
  const int nb = b_aligned ? min(slice_rows, kp.b_smem_bytes / (rank * 2)) : 0;
  const bf16* s_b = reinterpret_cast<const bf16*>(s_dyn);
  {
    const int bytes = nb * rank * 2;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(B + static_cast<int64_t>(n_begin) * rank);
    for (int c = threadIdx.x; c * 16 < bytes; c += kThreads)
      cp_async16(s_dyn + 16 * c, src + 16 * c, min(16, bytes - 16 * c));
    cp_async_commit();
  }
  if (threadIdx.x < kTok)
    s_tok[threadIdx.x] = static_cast<int>(threadIdx.x) < count ? meta[kMetaHeader + 4 * capacity + first + threadIdx.x] : -1;
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rtiles = (rank + 15) / 16;
  const int mtiles = (count + 7) / 8;
  const int kblocks = ceil_div(P.in, 128);
  const int my_kblocks = kblocks > crank ? ceil_div(kblocks - crank, cs) : 0;
  // Warps split the rank tiles; when there are fewer than 8 tiles, `groups` warps share a tile and
  // split this block's K blocks between them.
  const bool many = rtiles >= kWarps;
  const int groups = many ? 1 : kWarps / rtiles;
  float* s_part = reinterpret_cast<float*>(s_scratch);

  // ---- 1. shrink
  if (warp < (many ? kWarps : groups * rtiles)) {
    const int grp = many ? 0 : warp / rtiles;
    for (int rt = many ? warp : warp % rtiles; rt < rtiles; rt += many ? kWarps : rtiles) {
      float acc[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
      const int ra = rt * 16 + g, rb = ra + 8;
      const bool va = ra < rank, vb = rb < rank;
      for (int j = grp; j < my_kblocks; j += groups) {
        const int kc = (crank + j * cs) * 128 + t * 32;
        const bool kv = kc < P.in;
        const bf16* a0p = A + static_cast<int64_t>(va ? ra : 0) * P.in + (kv ? kc : 0);
        const bf16* a1p = A + static_cast<int64_t>(vb ? rb : 0) * P.in + (kv ? kc : 0);
        uint32_t row0[16], row1[16];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          // Each 8-value piece past the input's end reads nothing (zeros on both sides of the
          // product): `in` is a multiple of 8, not necessarily of the 32-value run.
          const bool kq = kc + 8 * q < P.in;
          const uint4 u0 = ldg_u4_pred(a0p + 8 * q, va && kq), u1 = ldg_u4_pred(a1p + 8 * q, vb && kq);
          row0[4 * q] = u0.x, row0[4 * q + 1] = u0.y, row0[4 * q + 2] = u0.z, row0[4 * q + 3] = u0.w;
          row1[4 * q] = u1.x, row1[4 * q + 1] = u1.y, row1[4 * q + 2] = u1.z, row1[4 * q + 3] = u1.w;
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          if (mt >= mtiles) break;
          const int tok = s_tok[mt * 8 + g];
          const bool tv = tok >= 0 && kv;
          const bf16* xr = P.x + static_cast<int64_t>(tv ? tok : 0) * P.ld_x + (kv ? kc : 0);
          uint32_t xw[16];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint4 u = ldg_u4_pred(xr + 8 * q, tv && kc + 8 * q < P.in);
            xw[4 * q] = u.x, xw[4 * q + 1] = u.y, xw[4 * q + 2] = u.z, xw[4 * q + 3] = u.w;
          }
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const uint32_t a[4] = {row0[2 * s], row1[2 * s], row0[2 * s + 1], row1[2 * s + 1]};
            mma_bf16_16816(acc[mt], a, xw[2 * s], xw[2 * s + 1]);
          }
        }
      }
      float* part = s_part + (grp * rtiles + rt) * 16 * kPS;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        *reinterpret_cast<float2*>(part + g * kPS + mt * 8 + 2 * t) = make_float2(acc[mt][0], acc[mt][1]);
        *reinterpret_cast<float2*>(part + (g + 8) * kPS + mt * 8 + 2 * t) = make_float2(acc[mt][2], acc[mt][3]);
      }
    }
  }
  __syncthreads();
  const int urows = rtiles * 16;
  for (int idx = threadIdx.x; idx < urows * kTok; idx += kThreads) {
    const int r = idx / kTok, c = idx % kTok;
    float s = 0.0f;
    for (int grp = 0; grp < groups; ++grp) s += s_part[(grp * urows + r) * kPS + c];
    s_my_u[r * kPS + c] = s;
  }

  // y values of one tile for this lane: [mt][(token 2t | 2t+1) x (row g | g+8)], read ahead.
  auto load_y = [&](int ot, unsigned short (&yv)[4][4]) {
    const int n0 = ot * 16 + g, n1 = n0 + 8;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const int tk0 = s_tok[mt * 8 + 2 * t], tk1 = s_tok[mt * 8 + 2 * t + 1];
      const unsigned short* y0 = reinterpret_cast<const unsigned short*>(P.y + static_cast<int64_t>(max(tk0, 0)) * P.ld_y);
      const unsigned short* y1 = reinterpret_cast<const unsigned short*>(P.y + static_cast<int64_t>(max(tk1, 0)) * P.ld_y);
      const bool live = mt < mtiles && ot < ot1;
      yv[mt][0] = live && tk0 >= 0 && n0 < P.out ? y0[n0] : 0;
      yv[mt][1] = live && tk1 >= 0 && n0 < P.out ? y1[n0] : 0;
      yv[mt][2] = live && tk0 >= 0 && n1 < P.out ? y0[n1] : 0;
      yv[mt][3] = live && tk1 >= 0 && n1 < P.out ? y1[n1] : 0;
    }
  };
  unsigned short ycur[4][4];
  load_y(ot0 + warp, ycur);  // in flight across the exchange below

  // ---- 2. exchange partial sums across the cluster
  cluster.sync();
  bf16* s_uh = reinterpret_cast<bf16*>(s_scratch);  // s_part is dead: the barrier above ordered its last reads
  bf16* s_ul = s_uh + kTok * kLDU;
  for (int idx = threadIdx.x; idx < urows * kTok; idx += kThreads) {
    const int r = idx / kTok, c = idx % kTok;
    float u = 0.0f;
    for (int b = 0; b < cs; ++b) u += cluster.map_shared_rank(s_my_u, b)[r * kPS + c];
    const bf16 hi = __float2bfloat16(u);
    s_uh[c * kLDU + r] = hi;
    s_ul[c * kLDU + r] = __float2bfloat16(u - __bfloat162float(hi));
  }
  cp_async_wait_all();
  __syncthreads();  // u (hi, lo) and the B_s slice are in shared memory for every warp

  // ---- 3. expand into this block's slice of out
  const bool vec = rank % 4 == 0 && (reinterpret_cast<uintptr_t>(B) & 7u) == 0;
  unsigned short ynext[4][4];
  for (int ot = ot0 + warp; ot < ot1; ot += kWarps) {
    const int n0 = ot * 16 + g, n1 = n0 + 8;
    const bool ok0 = n0 < P.out, ok1 = n1 < P.out;
    const int nl0 = n0 - n_begin, nl1 = n1 - n_begin;
    load_y(ot + kWarps, ynext);
    float acc[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
    for (int ks = 0; ks < rtiles; ++ks) {
      const int k0 = ks * 16 + 4 * t;
      const uint2 b0 = ok0 && nl0 < nb ? load_b_quad_smem(s_b, nl0, k0, rank) : load_b_quad(B, n0, ok0, k0, rank, vec);
      const uint2 b1 = ok1 && nl1 < nb ? load_b_quad_smem(s_b, nl1, k0, rank) : load_b_quad(B, n1, ok1, k0, rank, vec);
      const uint32_t a[4] = {b0.x, b1.x, b0.y, b1.y};
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt >= mtiles) break;
        const uint2 h = *reinterpret_cast<const uint2*>(s_uh + (mt * 8 + g) * kLDU + k0);
        const uint2 l = *reinterpret_cast<const uint2*>(s_ul + (mt * 8 + g) * kLDU + k0);
        mma_bf16_16816(acc[mt], a, h.x, h.y);
        mma_bf16_16816(acc[mt], a, l.x, l.y);
      }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt >= mtiles) break;
      const int tk0 = s_tok[mt * 8 + 2 * t], tk1 = s_tok[mt * 8 + 2 * t + 1];
      auto put = [&](int tok, int n, unsigned short yb, float v) {
        P.y[static_cast<int64_t>(tok) * P.ld_y + n] = __float2bfloat16(bf16_bits_lo(yb) + v);
      };
      if (tk0 >= 0 && ok0) put(tk0, n0, ycur[mt][0], acc[mt][0]);
      if (tk1 >= 0 && ok0) put(tk1, n0, ycur[mt][1], acc[mt][1]);
      if (tk0 >= 0 && ok1) put(tk0, n1, ycur[mt][2], acc[mt][2]);
      if (tk1 >= 0 && ok1) put(tk1, n1, ycur[mt][3], acc[mt][3]);
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ycur[mt][e] = ynext[mt][e];
  }

  // ---- 4. keep this block's shared memory alive until every block of the cluster has read it
  cluster.sync();
}

// Single-adapter path: the device pointer arrays cuBLAS's batched API reads, [x, u, y] per problem.
struct PtrParams {
  void* v[3 * kLoraMaxProblems];
  void** out;
  int n;
};
__global__ void write_ptrs_kernel(const __grid_constant__ PtrParams p) {
  if (threadIdx.x < p.n) p.out[threadIdx.x] = p.v[threadIdx.x];
}

int cluster_for(const LoraProblem* problems, int num_problems) {
  int kb = 1;
  for (int i = 0; i < num_problems; ++i) kb = std::max(kb, ceil_div(problems[i].in, 128));
  return std::min(8, kb);
}

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

int lora_max_items(int max_tokens, int num_slots, int num_problems) {
  return num_problems * std::min(max_tokens, num_slots + ceil_div(max_tokens, kTok));
}

size_t lora_meta_bytes(int capacity, int max_tokens) {
  return sizeof(int32_t) * (kMetaHeader + 4 * static_cast<size_t>(capacity) + max_tokens);
}

LoraPlan lora_plan(const int32_t* token_slot, int T, const LoraProblem* problems, int num_problems,
                   const LoraPlanOptions& opt, int capacity) {
  MOELORA_CHECK(num_problems >= 1 && num_problems <= kLoraMaxProblems);
  LoraPlan plan;
  plan.num_tokens = T;
  plan.num_problems = num_problems;
  plan.cluster = cluster_for(problems, num_problems);
  const int num_slots = problems[0].num_slots;
  for (int i = 0; i < num_problems; ++i) {
    const LoraProblem& pr = problems[i];
    MOELORA_CHECK_MSG(pr.num_slots == num_slots && pr.host_rank != nullptr, "LoRA problems disagree on slots");
    MOELORA_CHECK_MSG(pr.in % 8 == 0 && pr.in > 0 && pr.out > 0, "LoRA: in {} must be a multiple of 8", pr.in);
    for (int s = 0; s < num_slots; ++s)
      MOELORA_CHECK_MSG(pr.host_rank[s] >= 0 && pr.host_rank[s] <= kLoraMaxRank, "LoRA rank {} above {}",
                        pr.host_rank[s], kLoraMaxRank);
  }
  // Group tokens by slot (counting sort, stable); -1 tokens are left out.
  std::vector<int> count(num_slots + 1, 0);
  for (int t = 0; t < T; ++t) {
    const int s = token_slot[t];
    MOELORA_CHECK_MSG(s >= -1 && s < num_slots, "token slot {} outside {} slots", s, num_slots);
    if (s >= 0) ++count[s + 1];
  }
  std::vector<int> start(num_slots + 1, 0);
  for (int s = 0; s < num_slots; ++s) start[s + 1] = start[s] + count[s + 1];
  const int active = start[num_slots];
  // The single-adapter path: one distinct slot, no base-only token, whatever slot it is.
  if (opt.single_adapter_gemm && T >= std::max(1, opt.single_adapter_min_tokens) && active == T) {
    for (int s = 0; s < num_slots; ++s)
      if (count[s + 1] == T) {
        plan.single_adapter = true;
        plan.single_slot = s;
      }
  }
  std::vector<int32_t> perm(active);
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int t = 0; t < T; ++t)
      if (token_slot[t] >= 0) perm[fill[token_slot[t]]++] = t;
  }
  std::vector<int32_t> items;
  for (int s = 0; s < num_slots; ++s) {
    for (int f = start[s]; f < start[s + 1]; f += kTok) {
      const int c = std::min(kTok, start[s + 1] - f);
      for (int i = 0; i < num_problems; ++i)
        if (problems[i].host_rank[s] > 0) items.insert(items.end(), {i, s, f, c});
    }
  }
  plan.num_items = static_cast<int>(items.size() / 4);
  plan.capacity = capacity > 0 ? capacity : plan.num_items;
  MOELORA_CHECK_MSG(plan.num_items <= plan.capacity, "LoRA plan needs {} items, capacity {}", plan.num_items,
                    plan.capacity);
  plan.meta.assign(kMetaHeader + 4 * static_cast<size_t>(plan.capacity) + active, 0);
  plan.meta[0] = plan.num_items;
  plan.meta[1] = plan.capacity;
  plan.meta[2] = T;
  std::copy(items.begin(), items.end(), plan.meta.begin() + kMetaHeader);
  std::copy(perm.begin(), perm.end(), plan.meta.begin() + kMetaHeader + 4 * plan.capacity);
  return plan;
}

void lora_upload_plan(const LoraPlan& plan, void* dev_meta, size_t dev_bytes, cudaStream_t stream) {
  const size_t bytes = plan.meta.size() * sizeof(int32_t);
  MOELORA_CHECK_MSG(bytes <= dev_bytes, "LoRA metadata {} B exceeds the device buffer {} B", bytes, dev_bytes);
  MOELORA_CUDA_CHECK(cudaMemcpyAsync(dev_meta, plan.meta.data(), bytes, cudaMemcpyHostToDevice, stream));
}

void lora_dense_prepare() {
  static bool done = false;  // only the engine thread launches kernels (docs/architecture.md, data flow); idempotent
  if (done) return;
  MOELORA_CUDA_CHECK(cudaFuncSetAttribute(lora_segmented_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxBSmem));
  done = true;
}

void launch_lora_segmented(const LoraProblem* problems, int num_problems, int cluster, const void* dev_meta,
                           int grid_items, cudaStream_t stream) {
  if (grid_items <= 0) return;
  KernelParams kp{};
  for (int i = 0; i < num_problems; ++i) {
    const LoraProblem& s = problems[i];
    // The shrink reads x in 16-byte pieces (plans are reused across calls: checked per launch).
    MOELORA_CHECK_MSG(s.ld_x % 8 == 0 && reinterpret_cast<uintptr_t>(s.x) % 16 == 0,
                      "LoRA: x rows must be 16-byte aligned (ld {})", s.ld_x);
    kp.prob[i] = ProblemDev{s.x, s.ld_x, s.y, s.ld_y, s.in, s.out, s.a_ptrs, s.b_ptrs, s.ranks};
  }
  kp.meta = static_cast<const int32_t*>(dev_meta);
  kp.cluster = cluster;
  // Room for the largest block slice of B_s among the problems (every slot's rank), capped.
  int need = 0;
  for (int i = 0; i < num_problems; ++i) {
    const LoraProblem& pr = problems[i];
    int max_rank = 0;
    for (int sl = 0; sl < pr.num_slots; ++sl) max_rank = std::max(max_rank, pr.host_rank ? pr.host_rank[sl] : kLoraMaxRank);
    const int rows = (ceil_div(pr.out, 16) / cluster + 1) * 16;
    need = std::max(need, rows * max_rank * 2);
  }
  kp.b_smem_bytes = std::min(kMaxBSmem, (need + 15) / 16 * 16);
  lora_dense_prepare();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid_items * cluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(kp.b_smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, lora_segmented_kernel, kp));
}

// ---- single-adapter path

LoraContext::LoraContext() {
  MOELORA_CUBLAS_CHECK(cublasCreate(&handle_));
  // A fixed workspace keeps cuBLAS from allocating inside a stream capture.
  const size_t ws = size_t{8} << 20;
  MOELORA_CUDA_CHECK(cudaMalloc(&workspace_, ws));
  MOELORA_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_, ws));
}

LoraContext::~LoraContext() {
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

size_t lora_single_scratch_bytes(int max_tokens, const LoraProblem* problems, int num_problems) {
  size_t bytes = align256(3 * kLoraMaxProblems * sizeof(void*));
  for (int i = 0; i < num_problems; ++i) bytes += align256(static_cast<size_t>(max_tokens) * kLoraMaxRank * 2);
  return bytes;
}

void lora_run(LoraContext& ctx, const LoraProblem* problems, int num_problems, const LoraPlan& plan,
              const void* dev_meta, LoraScratch scratch, cudaStream_t stream, int grid_items) {
  MOELORA_CHECK(plan.num_problems == num_problems);
  if (plan.num_tokens == 0) return;
  if (!plan.single_adapter) {
    const int n = grid_items > 0 ? grid_items : plan.num_items;
    MOELORA_CHECK(n >= plan.num_items && n <= plan.capacity);
    launch_lora_segmented(problems, num_problems, plan.cluster, dev_meta, n, stream);
    return;
  }
  const int T = plan.num_tokens, s = plan.single_slot;
  MOELORA_CHECK_MSG(scratch.bytes >= lora_single_scratch_bytes(T, problems, num_problems),
                    "LoRA single-adapter scratch too small");
  auto* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(scratch.ptr) + 255) / 256 * 256);
  auto** ptrs = reinterpret_cast<void**>(base);
  unsigned char* u_base = base + align256(3 * kLoraMaxProblems * sizeof(void*));
  PtrParams pp{};
  pp.out = ptrs;
  pp.n = 3 * num_problems;
  for (int i = 0; i < num_problems; ++i) {
    pp.v[3 * i] = const_cast<__nv_bfloat16*>(problems[i].x);
    pp.v[3 * i + 1] = u_base + i * align256(static_cast<size_t>(T) * kLoraMaxRank * 2);
    pp.v[3 * i + 2] = problems[i].y;
  }
  write_ptrs_kernel<<<1, 32, 0, stream>>>(pp);
  MOELORA_CUDA_CHECK_LAUNCH();
  MOELORA_CUBLAS_CHECK(cublasSetStream(ctx.handle(), stream));
  const float one = 1.0f, zero = 0.0f;
  for (int i = 0; i < num_problems; ++i) {
    const LoraProblem& pr = problems[i];
    const int r = pr.host_rank[s];
    if (r == 0) continue;
    // u^T [r, T] = A_s [r, in] . x^T   (column-major: op(A) = A^T of the [in, r] view)
    MOELORA_CUBLAS_CHECK(cublasGemmBatchedEx(
        ctx.handle(), CUBLAS_OP_T, CUBLAS_OP_N, r, T, pr.in, &one,
        reinterpret_cast<const void* const*>(pr.a_ptrs + s), CUDA_R_16BF, pr.in,
        reinterpret_cast<const void* const*>(ptrs + 3 * i), CUDA_R_16BF, static_cast<int>(pr.ld_x), &zero,
        reinterpret_cast<void* const*>(ptrs + 3 * i + 1), CUDA_R_16BF, r, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    // y^T [out, T] += B_s [out, r] . u^T
    MOELORA_CUBLAS_CHECK(cublasGemmBatchedEx(
        ctx.handle(), CUBLAS_OP_T, CUBLAS_OP_N, pr.out, T, r, &one,
        reinterpret_cast<const void* const*>(pr.b_ptrs + s), CUDA_R_16BF, r,
        reinterpret_cast<const void* const*>(ptrs + 3 * i + 1), CUDA_R_16BF, r, &one,
        reinterpret_cast<void* const*>(ptrs + 3 * i + 2), CUDA_R_16BF, static_cast<int>(pr.ld_y), 1,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

}  // namespace moelora::cuda
