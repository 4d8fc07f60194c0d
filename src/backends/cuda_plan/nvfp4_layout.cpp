#include "backends/cuda_plan/nvfp4_layout.h"

#include "core/check.h"

namespace moelora::cuda_plan {

void nvfp4_pack_codes(const uint8_t* src, int64_t rows, int cols, uint8_t* dst) {
  MOELORA_CHECK_MSG(cols % kNvfp4Group == 0, "NVFP4 rows hold whole groups of 16, got {} columns", cols);
  const int64_t groups = rows * (cols / kNvfp4Group);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* in = src + g * 8;
    uint8_t q[kNvfp4Group];
    for (int i = 0; i < kNvfp4Group; ++i) q[i] = (in[i / 2] >> (4 * (i % 2))) & 0xf;
    for (int w = 0; w < 2; ++w) {
      uint32_t word = 0;
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = q[8 * w + 2 * j], hi = q[8 * w + 2 * j + 1];
        const uint32_t sel = (lo & 3) | ((lo >> 2) << 4) | ((hi & 3) << 8) | ((hi >> 2) << 12);
        word |= sel << nvfp4_pair_shift(j);
      }
      for (int b = 0; b < 4; ++b) dst[g * 8 + 4 * w + b] = static_cast<uint8_t>(word >> (8 * b));
    }
  }
}

int64_t nvfp4_packed_scale_offset(int64_t row, int group, int cols) {
  const int64_t chunks = cols / kNvfp4ChunkCols;
  const int groups_per_chunk = kNvfp4ChunkCols / kNvfp4Group;
  const int64_t tile = row / kNvfp4RowTile, chunk = group / groups_per_chunk;
  return ((tile * chunks + chunk) * kNvfp4RowTile + row % kNvfp4RowTile) * groups_per_chunk + group % groups_per_chunk;
}

void nvfp4_pack_scales(const uint8_t* src, int64_t rows, int cols, uint8_t* dst) {
  MOELORA_CHECK_MSG(nvfp4_layout_ok(rows, cols), "NVFP4 4-bit layout needs rows % 16 and cols % 64, got [{}, {}]",
                    rows, cols);
  const int groups = cols / kNvfp4Group;
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) dst[nvfp4_packed_scale_offset(r, g, cols)] = src[r * groups + g];
}

}  // namespace moelora::cuda_plan
