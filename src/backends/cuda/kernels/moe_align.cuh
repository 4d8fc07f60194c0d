// Alignment: (token, k) pairs grouped into row tiles for the grouped expert GEMMs, and by
// virtual expert (adapter slot, expert) for the MoE LoRA kernels. One CTA of 1024 threads
// counting-sorts on the device: nothing about the batch composition reaches the host, every
// buffer is sized for the worst case (moe_max_tiles), so a captured graph replays it as is.
//
// Sentinels (the peer's bugs #3, #4, #10, #17): a pair whose expert id is outside [0, E) is
// dropped from every grouping (it contributes nothing); a pair whose token slot is outside
// [0, num_slots) or whose slot has rank 0 on both halves goes to the LoRA "none" group, whose
// tiles carry slot = -1 and only ever write zeros. No id is ever offset by a slot before it is
// validated, so no pair can reach another adapter's or expert's weights.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels/moe_common.cuh"
#include "backends/cuda/kernels/router.cuh"

namespace moelora::cuda {

// Device counters written by moe_align (one int32 each): the tile counts the GEMM and LoRA
// kernels read on the device (their grids are sized for the worst case).
enum MoeCounter : int {
  kMoeCntTiles = 0,        // base tiles
  kMoeCntLoraTiles = 1,    // LoRA (slot, expert) tiles incl. the "none" group
  kMoeCntLoraGuTiles = 2,  // LoRA gate_up shrink tiles (per-expert A pair tiles + shared-A token tiles)
  kMoeNumCounters = 4,
};

// Worst-case number of tiles for `items` rows spread over at most `buckets` non-empty groups:
// sum_b ceil(n_b / rows) <= items / rows + min(buckets, items).
inline int moe_max_tiles(int items, int buckets, int rows) {
  return (items + rows - 1) / rows + (buckets < items ? buckets : items);
}

constexpr int kMoeLoraTileRows = 16;  // rows per LoRA tile (the LoRA kernels hold 16 accumulators)

struct MoeAlignParams {
  // Optional fused routing (decode): when route.logits is set the kernel first routes all T
  // tokens (route.ids must equal `ids`). Meant for small T (one CTA routes every token); E <= 256.
  RouterParams route;
  const int32_t* ids = nullptr;  // [T, k]
  int T = 0;
  int k = 0;
  int E = 0;

  // Base grouping (skipped when tiles == nullptr).
  int tile_rows = 8;              // rows per tile = the GEMM's token tile
  int32_t* sorted = nullptr;      // [T*k] pair indices grouped by expert
  MoeTile* tiles = nullptr;       // [max_tiles]
  int max_tiles = 0;              // >= moe_max_tiles(T*k, E, tile_rows)
  int32_t* tile_pairs = nullptr;  // [max_tiles * tile_rows] the pairs of each tile, -1 padded
  int32_t* counters = nullptr;    // [kMoeNumCounters]

  // LoRA grouping (skipped when token_slot == nullptr).
  const int32_t* token_slot = nullptr;   // [T] adapter slot or -1
  int num_slots = 0;
  const int32_t* gu_rank = nullptr;      // [num_slots] (device copy of MoeLoraTable ranks)
  const int32_t* d_rank = nullptr;
  const int64_t* gu_a_stride = nullptr;  // [num_slots] 0 = gate_up A shared by all experts
  int32_t* l_sorted = nullptr;           // [T*k] pairs grouped by (slot, expert), "none" last
  MoeTile* l_tiles = nullptr;            // [max_l_tiles] {expert, start, count, slot (-1 = none)}
  int max_l_tiles = 0;                   // >= moe_max_tiles(T*k, num_slots*E + 1, kMoeLoraTileRows)
  int32_t* t_sorted = nullptr;           // [T] tokens of shared-A slots grouped by slot
  MoeTile* g_tiles = nullptr;            // [max_g_tiles] gate_up shrink tiles; expert -1 = token tile
  int max_g_tiles = 0;                   // >= max_l_tiles + moe_max_tiles(T, num_slots, kMoeLoraTileRows)

  bool pdl = false;
};

// Bucket limit of the LoRA grouping (num_slots * E + 1), bounded by the CTA's shared memory.
constexpr int kMoeMaxLoraBuckets = 12288;

void moe_align(const MoeAlignParams& p, cudaStream_t stream);

}  // namespace moelora::cuda
