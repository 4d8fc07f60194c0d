// Hopper's 128-byte shared-memory swizzle for bf16 wgmma operands, as the kernels write tiles and as
// a wgmma matrix descriptor reads them. Pure arithmetic (constexpr: device code calls it too), so
// tests/cuda_plan checks on the CPU that what a kernel writes is what its descriptors read.
//
// A tile of `rows` rows of D bf16 is stored as D / 64 columns of rows x 128 bytes; within a column,
// 8-row atoms of 1024 bytes; 16-byte unit u of row r sits at unit u ^ (r % 8) (the swizzle the
// hardware applies to address bits [4, 7) from bits [7, 10), so tiles start 1024-aligned).
// - K-major operand (the MoE token tile, attention's K): rows are the MMA's M or N, the 64 values
//   of a column run along K. Descriptor (desc_sw128): start = column base + 32 bytes per k16 step
//   inside the 128-byte row, stride byte offset 1024 (8-row atoms).
// - MN-major operand (attention's V for P V, TRANS_B): rows run along K (positions), the 64 values
//   along N. Descriptor (desc_mn_sw128): start = column base + 2048 bytes per k16 step (16 rows),
//   stride byte offset 1024 (8-row k groups), leading byte offset = the stride between 64-wide N
//   blocks (one column: rows x 128 bytes). CUTLASS's canonical form, in 16-byte units:
//   Swizzle<3,4,3> o ((8, n), (8, k)) : ((1, LBO), (8, SBO)).
#pragma once

#include <cstdint>

namespace moelora::cuda_plan {

inline constexpr int kSw128RowBytes = 128;
inline constexpr int kSw128AtomBytes = 1024;

// The swizzle of a byte offset from a 1024-aligned base.
constexpr int sw128_swizzle(int offset) { return offset ^ (((offset >> 7) & 7) << 4); }

// Where a kernel writes 16-byte piece q (values 8q..8q+7) of row r of a tile of `rows` rows.
constexpr int sw128_piece_offset(int rows, int r, int q) {
  return (q >> 3) * rows * kSw128RowBytes + sw128_swizzle(r * kSw128RowBytes + (q & 7) * 16);
}

// What a K-major descriptor with start `start` (relative to the tile's 1024-aligned base) and
// stride byte offset `sbo` reads for row n (< the MMA's M or N) and value k (< 16) of its k16 step.
constexpr int sw128_kmajor_read(int start, int sbo, int n, int k) {
  return sw128_swizzle(start + (n / 8) * sbo + (n % 8) * kSw128RowBytes + k * 2);
}

// What an MN-major descriptor (start, leading byte offset lbo, stride byte offset sbo) reads for
// value k (< 16) along K and n along N.
constexpr int sw128_mnmajor_read(int start, int lbo, int sbo, int k, int n) {
  return sw128_swizzle(start + (n / 64) * lbo + (n % 64) * 2 + (k / 8) * sbo + (k % 8) * kSw128RowBytes);
}

}  // namespace moelora::cuda_plan
