// One routed-MoE layer from the kernels of router / moe_align / moe_gemm / moe_lora: the
// worst-case scratch layout and the launch sequence, including the side-stream LoRA handoff.
// The CUDA backend can call moe_forward as is or copy its sequence; tests/ops and dev/ use it.
//
// Sequence (main stream M, side stream S, events created by the caller before any capture):
//   M: [fp8 quant x]  [router_topk]  moe_align (base tiles + LoRA groups; routing fused in when fuse_route;
//      no LoRA groups with lora_direct, where the LoRA kernels take one item per routed pair)
//   lora_in_gemm (the default):
//   M: gate_up shrink -> u, moe_gate_up(+ u . B in its epilogue, before SwiGLU) -> act, record ev_act
//   otherwise:
//   M: record ev_ids ─► S: wait ev_ids, gate_up shrink, gate_up expand -> delta_gu, record ev_gu
//   M: wait ev_gu, moe_gate_up(+ delta_gu before SwiGLU) -> act, record ev_act
//   S: wait ev_act, down shrink(act), down expand -> delta_d, record ev_d
//   M: [fp8 quant act]  moe_down -> y (concurrently with S), wait ev_d, moe_reduce(y, delta_d) -> out
//   lora_down_in_reduce: S runs only the down shrink, and moe_reduce adds u . B itself (no delta_d).
//   lora_shrink_beside_gemm: one stream, each GEMM right behind its half's LoRA kernels, waiting for
//   them only before its epilogue (MoeGemmParams::wait_before_epilogue), so they run beside its
//   main loop:
//   M: gate_up LoRA, moe_gate_up, [fp8 quant act], down LoRA, moe_down, moe_reduce (PDL throughout)
// (the fp8 quantisations only in the W8A8 regime, MoeTuning::act_fp8 with FP8 experts)
// No buffer is written by one stream while the other reads it without an event in between; no
// allocation happens anywhere (all scratch is the caller's MoeWorkspace). Without a side stream
// the LoRA kernels run on M in the same order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_gemm.cuh"
#include "backends/cuda/kernels/moe_lora.cuh"
#include "backends/cuda/kernels/router.cuh"

namespace moelora::cuda {

struct MoeShape {
  int max_tokens = 0;  // the largest T this workspace serves (the largest captured batch)
  int k = 0, E = 0, H = 0, I = 0;
  bool fp8_activations = false;  // carve the W8A8 buffers (only when W8A8 may run: they cost arena)
  bool fp8_split = false;        // carve the split-form buffers (FP8 experts on the wgmma path)
};
struct MoeLoraShape {
  int num_slots = 0;
  int max_rank = 0;  // over both halves and all slots, <= 128
};

// Scratch of one MoE layer call (reusable by every layer: layers run one after the other).
struct MoeWorkspace {
  int32_t* counters = nullptr;  // [kMoeNumCounters]
  int32_t* sorted = nullptr;    // [P]           P = max_tokens * k
  MoeTile* tiles = nullptr;     // [max_tiles]   sized for the smallest GEMM tile (8 rows)
  int max_tiles = 0;
  int32_t* tile_pairs = nullptr;  // [P + 64 * min(E, P)] each tile's pairs, padded to its rows
  bf16* act = nullptr;          // [P, I]
  float* y = nullptr;           // [P, H]
  // W8A8 (MoeTuning::act_fp8): e4m3 copies of x and act with per-token 1x128 scales (null
  // unless the shape asked for them).
  uint8_t* xq = nullptr;        // [max_tokens, H]
  float* xs = nullptr;          // [max_tokens, ceil(H / 128)]
  uint8_t* aq = nullptr;        // [P, I]
  float* as = nullptr;          // [P, ceil(I / 128)]
  // MoeTuning::act_split: the low terms of x and act in fp8_quant's split form (xq / aq hold the
  // high terms, xs / as the power-of-two scales).
  uint8_t* xq_lo = nullptr;     // [max_tokens, H]
  uint8_t* aq_lo = nullptr;     // [P, I]
  // LoRA (null when the workspace was carved without a MoeLoraShape)
  int32_t* l_sorted = nullptr;  // [P]
  MoeTile* l_tiles = nullptr;
  int max_l_tiles = 0;
  int32_t* t_sorted = nullptr;  // [max_tokens]
  MoeTile* g_tiles = nullptr;
  int max_g_tiles = 0;
  float* u_gu_pair = nullptr;   // [P, ldu]
  float* u_gu_tok = nullptr;    // [max_tokens, ldu]
  float* u_d = nullptr;         // [P, ldu]
  int ldu = 0;
  bf16* delta_gu = nullptr;     // [P, 2I]
  bf16* delta_d = nullptr;      // [P, H]
};

size_t moe_workspace_bytes(const MoeShape& s, const MoeLoraShape* lora);
// Carves `base` (>= moe_workspace_bytes, 256-byte aligned) into the buffers above.
MoeWorkspace moe_workspace_carve(void* base, const MoeShape& s, const MoeLoraShape* lora);

// Device pointer tables of one layer's MoeLoraTable.
struct MoeLoraDevice {
  int num_slots = 0;
  int max_rank = 0;
  MoeLoraFactors gu_a, gu_b, d_a, d_b;  // gu_a.stride == 0 marks a shared gate_up A
};

struct MoeForwardArgs {
  int T = 0;
  const bf16* x = nullptr;  // [T, ldx] hidden states
  int64_t ldx = 0;
  // Routing: with `logits` the router runs first (its mode, bias, groups, scaling and renormalize
  // taken from `router`); otherwise ids/weights are inputs.
  const float* logits = nullptr;
  RouterParams router;
  int32_t* ids = nullptr;      // [T, k]
  float* weights = nullptr;    // [T, k]
  // Experts (layouts in moe_gemm.cuh).
  MoeWeightType wtype = MoeWeightType::kFp8;
  const void* w_gate_up = nullptr;
  const float* s_gate_up = nullptr;
  const void* w_down = nullptr;
  const float* s_down = nullptr;
  // NVFP4 experts (wtype kNvfp4; the tensor-core kernels): group and global scales of each GEMM.
  const uint8_t* group_scale_gate_up = nullptr;
  const float* global_scale_gate_up = nullptr;
  const uint8_t* group_scale_down = nullptr;
  const float* global_scale_down = nullptr;
  MoeShape shape;
  // LoRA (null = base only).
  const MoeLoraDevice* lora = nullptr;
  const int32_t* token_slot = nullptr;  // [T]
  bf16* out = nullptr;                  // [T, ldo]
  int64_t ldo = 0;
  // Kernel choices: cuda_plan::choose_moe_tuning of the problem unless given (tests and the
  // workbench force variants here).
  std::optional<cuda_plan::MoeTuning> tuning;
  bool allow_fp8_activations = false;  // the heuristic may pick W8A8 (cuda_plan::MoeProblem)
};
// The choices moe_forward makes for `a` (its tuning, or the host heuristic's).
cuda_plan::MoeTuning moe_tuning(const MoeForwardArgs& a);

struct MoeStreams {
  cudaStream_t main = nullptr;
  cudaStream_t side = nullptr;  // null: LoRA runs on main
  cudaEvent_t ev_ids = nullptr, ev_gu = nullptr, ev_act = nullptr, ev_d = nullptr;  // needed with side
};

void moe_forward(const MoeForwardArgs& a, const MoeWorkspace& ws, const MoeStreams& st);
// The base layer's launches up to and including `last`, for the workbench's stage timings
// (dev/moe_bench.cu times the prefixes); without LoRA only. moe_forward runs every stage.
enum class MoeStage { kRouteAlign = 1, kGateUp = 2, kDown = 3, kAll = 4 };
void moe_forward_prefix(const MoeForwardArgs& a, const MoeWorkspace& ws, const MoeStreams& st, MoeStage last);

}  // namespace moelora::cuda
