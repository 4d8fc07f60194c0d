// MoE LoRA as "virtual experts": the (adapter slot, expert) groups of moe_align's LoRA grouping
// each read their A and B once (the bytes LoRA must move), with mixed ranks 1..128 and slots
// -1 / rank 0 untouched.
//   shrink: u[row, j] = x[row] . A[j]          A = a_ptr[s] + e * a_stride[s], [r, K]   (f32 out)
//   expand: out[p, o] = sum_j u[p, j] B[o, j]  B = b_ptr[s] + e * b_stride[s], [N, r]   (bf16 out)
// The expand writes EVERY pair's row of `out`: LoRA pairs get their delta, all other pairs
// (slot -1, rank 0, "none" group) get zeros, so consumers add the buffer unconditionally.
//
// gate_up: shrink over g_tiles (per-expert-A pairs: x row p / top_k -> u_pair[p]; shared-A
// (a_stride 0) slots: token tiles, x row t -> u_tok[t], once per token instead of k times),
// expand over l_tiles into the pre-activation delta [P, 2I] that moe_gate_up adds before SwiGLU
// (no routing weight). down: shrink over l_tiles (x = act, row p -> u_pair[p]), expand into the
// delta [P, H] that moe_reduce adds before the routing weight. Shared B (b_stride 0) needs
// nothing special: every expert group reads the same B (from L2 after the first).
//
// Alignment: factor base pointers 16-byte aligned, A strides multiples of 8 elements; B rows are
// read with 16-byte loads when r % 8 == 0 and B is 16-byte aligned, element by element otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/moe_common.cuh"

namespace moelora::cuda {

// Per-slot factor tables of one projection half (device copies of MoeLoraTable columns).
struct MoeLoraFactors {
  const int64_t* ptr = nullptr;     // [num_slots] element address (bf16) or 0
  const int64_t* stride = nullptr;  // [num_slots] elements between experts (0 = shared)
  const int32_t* rank = nullptr;    // [num_slots]
};

// Per-pair items instead of moe_align's (slot, expert) groups (MoeTuning::lora_direct): item p is
// routed pair p alone, its slot and expert read from token_slot and ids, so moe_align skips the LoRA
// grouping and the LoRA grids are sized by the step's P = T * top_k on the host (graph-safe: a
// captured step has a fixed T). Each pair then reads its own factors, from L2 when pairs of one
// (slot, expert) run together; the per-row sums are the grouped kernels' (same loops, one row per
// tile), so both forms give the same bits. Pairs with an expert id outside [0, E), an out-of-range
// slot or rank 0 are the "none" group: no shrink, zero delta rows.
struct MoeLoraPairs {
  const int32_t* ids = nullptr;         // [P] expert of each pair; null: the grouped form
  const int32_t* token_slot = nullptr;  // [T]
  int pairs = 0;                        // P
  int top_k = 1;
  int E = 0;
};

struct MoeLoraShrinkParams {
  const bf16* x = nullptr;         // gate_up: hidden [T, K]; down: act [P, K]
  int64_t ldx = 0;
  int K = 0;
  int x_row_div = 1;               // pair tiles read x row p / x_row_div (gate_up: top_k; down: 1)
  const MoeTile* tiles = nullptr;  // gate_up: g_tiles; down: l_tiles
  const int32_t* num_tiles = nullptr;
  int max_tiles = 0;
  const int32_t* sorted_pairs = nullptr;   // l_sorted
  const int32_t* sorted_tokens = nullptr;  // t_sorted (token tiles, expert == -1)
  MoeLoraFactors a;
  int num_slots = 0;
  int max_rank = 0;                // max rank over slots, <= ldu
  float* u_pair = nullptr;         // [P, ldu]
  float* u_tok = nullptr;          // [T, ldu] (gate_up with shared-A slots)
  int ldu = 0;
  // Per-pair form (tiles, num_tiles, sorted_* unused). gate_up (u_tok set): a shared-A slot's u
  // row is computed once per token, by the token's first pair, as the grouped token tiles do.
  MoeLoraPairs direct;
  bool pdl = false;
};
void moe_lora_shrink(const MoeLoraShrinkParams& p, cudaStream_t stream);

struct MoeLoraExpandParams {
  const float* u_pair = nullptr;
  const float* u_tok = nullptr;
  int ldu = 0;
  int top_k = 1;
  const int64_t* a_stride = nullptr;  // gate_up: a slot with a_stride 0 reads u_tok[p / top_k]; down: null
  const MoeTile* tiles = nullptr;     // l_tiles (incl. the "none" group, slot -1)
  const int32_t* num_tiles = nullptr;
  int max_tiles = 0;
  const int32_t* sorted_pairs = nullptr;
  MoeLoraFactors b;
  int num_slots = 0;
  int N = 0;                          // output width (gate_up 2I, down H), even
  bf16* out = nullptr;                // [P, N]
  MoeLoraPairs direct;                // per-pair form (tiles, num_tiles, sorted_pairs unused)
  bool pdl = false;
};
void moe_lora_expand(const MoeLoraExpandParams& p, cudaStream_t stream);

// shrink + expand in one launch over l_tiles (one CTA per (tile, 512 output columns), u kept in
// shared memory). Same outputs as moe_lora_shrink + moe_lora_expand; the shrink runs per pair
// also for shared-A slots (A then comes from L2 for every expert group: same HBM bytes, more L2
// reads) — the two-kernel path's once-per-token shrink is the one to use when that matters
// (prefill). Half the launches and no u round trip through HBM: meant for decode.
struct MoeLoraFusedParams {
  const bf16* x = nullptr;  // gate_up: hidden [T, K] (x_row_div = top_k); down: act [P, K] (x_row_div = 1)
  int64_t ldx = 0;
  int K = 0;
  int x_row_div = 1;
  const MoeTile* tiles = nullptr;  // l_tiles
  const int32_t* num_tiles = nullptr;
  int max_tiles = 0;
  const int32_t* sorted_pairs = nullptr;  // l_sorted
  MoeLoraFactors a, b;                    // ranks from a.rank (the half's rank array)
  int num_slots = 0;
  int N = 0;
  bf16* out = nullptr;                    // [P, N], every row written
  MoeLoraPairs direct;                    // per-pair form (tiles, num_tiles, sorted_pairs unused)
  bool pdl = false;
};
void moe_lora_fused(const MoeLoraFusedParams& p, cudaStream_t stream);

constexpr int kMoeLoraMaxRank = 128;

// The gate_up half's expand inside the gate_up GEMM's epilogue (MoeTuning::lora_in_gemm): the
// epilogue that turns a pair's two pre-activation columns (gate f, up I + f) into act adds
// u[p] . B[f] and u[p] . B[I + f] itself, from the u rows moe_lora_shrink wrote over g_tiles. No
// expand launch and no [P, 2I] delta round trip through memory on the critical path; B is read
// per (pair, column) instead of once per (slot, expert) tile, from L1/L2 after the first row.
// Bit for bit moe_lora_expand + the delta add: the same f32 sum order (j ascending, fmaf from 0)
// and the same bf16 rounding of the delta before it is added.
struct MoeLoraGateUp {
  const int32_t* token_slot = nullptr;  // [T] adapter slot per token; null: no LoRA in the epilogue
  int num_slots = 0;
  int top_k = 1;
  const float* u_pair = nullptr;        // [P, ldu]
  const float* u_tok = nullptr;         // [T, ldu] (slots whose gate_up A is shared over experts)
  int ldu = 0;
  const int64_t* a_stride = nullptr;    // gate_up A strides per slot (0: u in u_tok)
  MoeLoraFactors b;                     // gate_up B, [2I, r] per expert
};

// The down half's expand inside moe_reduce (MoeTuning::lora_down_in_reduce): the weighted sum
// over k adds u[p] . B[h] of each routed pair itself, from the u rows moe_lora_shrink wrote over
// l_tiles (x = act). No expand launch and no [P, H] delta round trip; B rows come from L1/L2 after
// the first token of a (slot, expert). Bit for bit moe_lora_expand + the delta add, as above.
struct MoeLoraDown {
  const int32_t* token_slot = nullptr;  // [T] adapter slot per token; null: no LoRA in the reduce
  int num_slots = 0;
  const float* u = nullptr;             // [P, ldu] (u_d)
  int ldu = 0;
  MoeLoraFactors b;                     // down B, [H, r] per expert
};

#ifdef __CUDACC__
// u . B row (r values), f32, j ascending: moe_lora_expand's sum. Rows of 16 bytes when `vec`.
__device__ __forceinline__ float moe_lora_row_dot(const float* u, const bf16* row, int r, bool vec) {
  float acc = 0.0f;
  if (vec) {
    for (int j = 0; j < r; j += 8) {
      float b[8];
      moe_detail::unpack8(moe_detail::ldg16(row + j), b);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(u[j + i], b[i], acc);
    }
  } else {
    for (int j = 0; j < r; ++j) acc = fmaf(u[j], __bfloat162float(row[j]), acc);
  }
  return acc;
}

// The B factor of a pair whose token sits in slot `s` and is routed to `expert`, and its rank; null
// (rank 0) for tokens without an adapter (slot < 0 or out of range) and for rank-0 slots, whose
// deltas moe_lora_expand writes as 0.
struct MoeLoraPairB {
  const bf16* B = nullptr;  // [N, r] rows of this (slot, expert)
  int r = 0;
  bool vec = false;         // rows of 16 bytes (moe_lora_row_dot)
};
__device__ __forceinline__ MoeLoraPairB moe_lora_pair_b(const MoeLoraFactors& b, int num_slots, int s, int expert) {
  MoeLoraPairB pb;
  pb.r = (s >= 0 && s < num_slots) ? min(b.rank[s], kMoeLoraMaxRank) : 0;
  if (pb.r == 0) return pb;
  pb.B = reinterpret_cast<const bf16*>(b.ptr[s]) + expert * b.stride[s];
  pb.vec = pb.r % 8 == 0 && (reinterpret_cast<uintptr_t>(pb.B) & 15) == 0;
  return pb;
}
// Row `row` of the pair's delta, rounded to bf16 as the delta buffer stores it (0 without B).
__device__ __forceinline__ float moe_lora_delta(const MoeLoraPairB& pb, const float* u, int64_t row) {
  if (pb.r == 0) return 0.0f;
  return __bfloat162float(__float2bfloat16_rn(moe_lora_row_dot(u, pb.B + row * pb.r, pb.r, pb.vec)));
}

// The LoRA deltas of pair `pair` (routed to `expert`) for its gate column f and up column I + f.
__device__ __forceinline__ void moe_lora_gate_up_delta(const MoeLoraGateUp& l, int64_t pair, int expert, int I, int f,
                                                       float& d_gate, float& d_up) {
  const int s = l.token_slot[pair / l.top_k];
  const MoeLoraPairB pb = moe_lora_pair_b(l.b, l.num_slots, s, expert);
  if (pb.r == 0) {
    d_gate = d_up = 0.0f;
    return;
  }
  const float* u = l.a_stride[s] == 0 ? l.u_tok + (pair / l.top_k) * l.ldu : l.u_pair + pair * l.ldu;
  d_gate = moe_lora_delta(pb, u, f);
  d_up = moe_lora_delta(pb, u, I + f);
}

// The down half of pair `pair` (token `pair / top_k`, routed to `expert`): its B (moe_reduce looks
// it up once per pair and takes moe_lora_delta of each of its columns with u_d[pair]).
__device__ __forceinline__ MoeLoraPairB moe_lora_down_b(const MoeLoraDown& l, int64_t pair, int top_k, int expert) {
  return moe_lora_pair_b(l.b, l.num_slots, l.token_slot[pair / top_k], expert);
}
#endif

}  // namespace moelora::cuda
