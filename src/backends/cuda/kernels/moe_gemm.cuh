// Grouped expert GEMMs of the routed MoE MLP, over the tiles of moe_align:
//   moe_gate_up: act[p] = silu(g) * u,  (g | u) = x[p / k] Wgu[e]^T (+ lora_delta[p])   [P, I] bf16
//   moe_down:    y[p]   = act[p] Wd[e]^T                                               [P, H] f32
//   moe_reduce:  out[t] = sum_j w[t,j] (y[t*k+j] + lora_down_delta[t*k+j])              [T, H] bf16
// Weights are FP8 e4m3 with 128x128 block scales (or bf16). FP8 is dequantised exactly in
// registers to bf16 and multiplied on the tensor cores (mma.sync m16n8k16, f32 accumulation);
// the block scale is applied in f32 per 64-wide K chunk, so the only rounding besides f32
// accumulation is the bf16 storage of act (W8A16: activations are never quantised).
//
// Layouts (as packed by the CUDA backend's upload_experts):
//   gate_up w [E * 2I, H], expert e rows [e*2I, e*2I + I) gate, [e*2I + I, (e+1)*2I) up;
//           scale [E * 2*ceil(I/128), ceil(H/128)]: per expert ceil(I/128) gate row blocks, then
//           ceil(I/128) up row blocks (split_rows applied per expert).
//   down    w [E * H, I], scale [E * ceil(H/128), ceil(I/128)].
// Requirements: H % 64 == 0, I % 64 == 0 (K chunks of 64; the kernels assert).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/moe_common.cuh"

namespace moelora::cuda {

enum class MoeWeightType : int32_t { kFp8 = 0, kBf16 = 1 };

// Tile shape of one GEMM launch. Picked on the host from the batch shape (moe_gemm_config) and
// handed to moe_align as its tile_rows, so the routing tiles and the GEMM agree.
enum class MoeGemmTile : int32_t {
  kDecode8 = 0,    // 8-token tiles, 4 warps split K: few tokens per expert, memory-bound
  kDecode16 = 1,   // 16-token tiles
  kDecode32 = 2,   // 32-token tiles
  kPrefill64 = 3,  // 64-token tiles, 4 warps split the weight rows and share the token tile
};
int moe_gemm_tile_rows(MoeGemmTile t);
// Tile for a batch of T tokens routed to k of E experts (expected tokens per expert T*k/E).
// `H`, `I` restrict the prefill tile to shapes it divides.
MoeGemmTile moe_gemm_config(int T, int k, int E, int H, int I);

struct MoeGemmParams {
  MoeWeightType wtype = MoeWeightType::kFp8;
  MoeGemmTile tile = MoeGemmTile::kDecode8;
  int E = 0, H = 0, I = 0, top_k = 0;
  const void* w = nullptr;          // gate_up or down weights (see layout above)
  const float* w_scale = nullptr;   // FP8 only
  const bf16* x = nullptr;          // gate_up: hidden [T, H] (row p / top_k); down: act [P, I] (row p)
  int64_t ldx = 0;                  // elements
  // Routing (moe_align outputs).
  const int32_t* tile_pairs = nullptr;  // [tiles, tile_rows] pair per tile row, -1 = padding
  int align_tile_rows = 0;              // moe_align's tile_rows: must equal moe_gemm_tile_rows(tile)
  const MoeTile* tiles = nullptr;
  const int32_t* counters = nullptr;    // moe_align counters (kMoeCntTiles)
  int max_tiles = 0;                    // worst case, sizes the persistent grid
  // gate_up epilogue
  const bf16* lora_delta = nullptr;  // [P, 2I] gate_up LoRA delta (pre-activation) or null
  bf16* act = nullptr;               // [P, I]
  // down epilogue
  float* y = nullptr;                // [P, H]
  bool pdl = false;
  // Down only: the launch directly follows moe_gate_up, both with PDL, and moe_align precedes
  // gate_up: the kernel may then read the tiles and prefetch its first weights before waiting.
  bool early_prefetch = false;
};

void moe_gate_up(const MoeGemmParams& p, cudaStream_t stream);
void moe_down(const MoeGemmParams& p, cudaStream_t stream);

struct MoeReduceParams {
  const float* y = nullptr;           // [P, H]
  const bf16* lora_delta = nullptr;   // [P, H] down LoRA delta or null
  const int32_t* ids = nullptr;       // [T, k] (pairs with ids outside [0, E) are skipped)
  const float* weights = nullptr;     // [T, k]
  int T = 0, k = 0, E = 0, H = 0;
  bf16* out = nullptr;                // [T, ldo]
  int64_t ldo = 0;
  bool pdl = false;
};
void moe_reduce(const MoeReduceParams& p, cudaStream_t stream);

// Sets kernel attributes (shared-memory limits) and caches occupancy for every GEMM variant.
// Called lazily by the launchers; call it once before capturing a graph.
void moe_gemm_init();

}  // namespace moelora::cuda
