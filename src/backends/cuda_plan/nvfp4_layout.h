// The 4-bit expert layout of the CUDA grouped GEMMs (moe_gemm.cu, MoeWeightType::kNvfp4), on the
// host: the CUDA backend packs NVFP4 checkpoints with these functions, and tests/cuda_plan checks
// on the CPU, for every code and every scale, that what the kernel computes from the packed bytes
// is the exact dequantised weight (docs/numerics.md "NVFP4 on the GPU").
//
// Why this layout. The grouped GEMM gives each lane 16 consecutive k of a weight row per 64-wide
// chunk (moe_gemm.cu "Fragment mapping"): exactly one NVFP4 group. The lane turns its 16 codes into
// eight bf16x2 MMA registers. Hopper has no e2m1 conversion, so each register is one byte
// permutation (PRMT) through two 4-byte tables:
//   bf16 bits of an e2m1 code q = s.e1.e0.m placed as (s << 15) | (e1 e0 m << 6) are the bf16
//   number e2m1(q) * 2^-126 (exponent bias 127 instead of 1; e = 0 lands on bf16 subnormals,
//   which is the e2m1 subnormal rule). Its low byte (m, e0 at bits 6, 7) depends on q & 3 only,
//   its high byte (e1 at bit 0, s at bit 7) on q >> 2 only: 4-entry tables, kNvfp4LoTable and
//   kNvfp4HiTable, and PRMT looks up 4 bytes at once from 3-bit selectors.
// The packed word holds, for each of its four registers j, the 8 selector bits of one pair of codes
// (lo, hi) at bits nvfp4_pair_shift(j) + {0,1: lo & 3; 4,5: lo >> 2; 8,9: hi & 3; 12,13: hi >> 2}:
// the four shifts tile the 32 bits, so the selector of register j is
//   ((word >> shift_j) & 0x3333) | 0x4040
// (0x4040 points the high-byte selectors at the second table). Register j of word w holds the
// group's codes 8w + 2j (low half) and 8w + 2j + 1 (high half).
//
// Scales: the kernel multiplies each register by its group's scale as bf16 e4m3 * 2^100 (exact),
// so the products are e2m1 * e4m3 * 2^-26, exact in bf16 (at most 2 + 4 significant bits, all
// normal). The per-tensor global scale, times 2^26, multiplies the f32 sums in the epilogue.
// The group scales are stored tile-major, [rows / 16][cols / 64][16 rows][4 groups], so a 16-row
// MMA tile's scales of one chunk are 64 contiguous bytes (four 16-byte copies).
#pragma once

#include <cstdint>

namespace moelora::cuda_plan {

inline constexpr int kNvfp4Group = 16;         // codes per scale (one lane's k of a chunk)
inline constexpr int kNvfp4RowTile = 16;       // rows of one scale tile (an m16 MMA tile)
inline constexpr int kNvfp4ChunkCols = 64;     // k of one GEMM chunk: 4 groups
inline constexpr uint32_t kNvfp4LoTable = 0xC0804000u;  // low byte of the bf16 bits by q & 3
inline constexpr uint32_t kNvfp4HiTable = 0x81800100u;  // high byte by q >> 2
inline constexpr int kNvfp4ScaleExp = 100;     // group scales enter the MMA as e4m3 * 2^100
inline constexpr float kNvfp4GlobalFactor = 67108864.0f;  // 2^26: undoes 2^-126 * 2^100

// Shapes the 4-bit layout takes: whole 64-wide chunks along K and whole 16-row tiles.
constexpr bool nvfp4_layout_ok(int64_t rows, int cols) {
  return rows > 0 && cols > 0 && rows % kNvfp4RowTile == 0 && cols % kNvfp4ChunkCols == 0;
}

// Codes of a row-major NVFP4 matrix [rows, cols / 2] in checkpoint order (element 2j in the low
// nibble of byte j) -> the kernel order above, group by group (8 bytes each, same place).
void nvfp4_pack_codes(const uint8_t* src, int64_t rows, int cols, uint8_t* dst);
// Group scales [rows, cols / 16] (e4m3 bytes) -> the tile-major order above. nvfp4_layout_ok.
void nvfp4_pack_scales(const uint8_t* src, int64_t rows, int cols, uint8_t* dst);
// Byte offset of the scale of (row, group) in the packed scales (the inverse map, for tests).
int64_t nvfp4_packed_scale_offset(int64_t row, int group, int cols);

// The wgmma GEMM's view (moe_gemm_wgmma.cu): a stage holds 128-wide K chunks. Its scale box copies,
// for each 16-row tile, the 128 bytes of chunk c at tile-major offset c * 128 (two 64-wide chunks
// of [16 rows][4 groups]); this is the byte of (row in the tile, group s = 0..7 of the chunk)
// within them. Its lanes take one group per k16 step: lane c holds k 2c, 2c + 1 and 2c + 8, 2c + 9
// of the step, which are register c of the group's word 0 and word 1.
constexpr int nvfp4_chunk128_scale_byte(int row_in_tile, int s) { return (s >> 2) * 64 + row_in_tile * 4 + (s & 3); }

// The PTX `prmt.b32` default mode (what __byte_perm compiles to) for selectors whose nibbles have
// bit 3 clear: result byte i = byte (s >> 4i) & 7 of the 8-byte value y:x.
constexpr uint32_t prmt_model(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
// Where register j's selector bits start in a packed word: 0, 2, 16, 18 (a function, not a table,
// so device code can call it: --expt-relaxed-constexpr).
constexpr int nvfp4_pair_shift(int j) { return 2 * (j & 1) + 16 * (j >> 1); }
// The selector of the register whose bits start at `shift` (nvfp4_pair_shift) of a packed word, as
// the kernels build it (a lane that always takes the same register computes the shift once).
constexpr uint32_t nvfp4_selector_at(uint32_t word, int shift) { return ((word >> shift) & 0x3333u) | 0x4040u; }
// The selector of register j of a packed word.
constexpr uint32_t nvfp4_selector(uint32_t word, int j) { return nvfp4_selector_at(word, nvfp4_pair_shift(j)); }
// The bf16x2 bits of register j of a packed word (values e2m1 * 2^-126), as the kernel's PRMT
// makes them: the host model tests/cuda_plan checks against the executable spec.
constexpr uint32_t nvfp4_pair_bits(uint32_t word, int j) {
  return prmt_model(kNvfp4LoTable, kNvfp4HiTable, nvfp4_selector(word, j));
}
// bf16 bits of an e4m3 byte placed as (s << 15) | (eeee.mmm << 4): the value e4m3 * 2^-120 (the
// kernel then multiplies by 2^110 twice to get e4m3 * 2^kNvfp4ScaleExp).
constexpr uint32_t e4m3_as_bf16_bits(uint32_t b) { return ((b & 0x80u) << 8) | ((b & 0x7fu) << 4); }

}  // namespace moelora::cuda_plan
