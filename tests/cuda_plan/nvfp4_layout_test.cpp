// The 4-bit expert layout (cuda_plan/nvfp4_layout.h), checked on the CPU against the executable
// spec (ops dequantize_nvfp4): for every code in every register position, every e4m3 scale, and
// a whole packed matrix read back the way the kernel addresses it, what the kernel's byte
// permutation and bf16 products compute is the dequantised weight, bit for bit. The kernel's PRMT
// is modelled by prmt_model (PTX prmt.b32, default mode, selector bit 3 clear).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "backends/cuda_plan/nvfp4_layout.h"
#include "core/dtype.h"
#include "ops/weight_format.h"

namespace moelora::cuda_plan {
namespace {

bool is_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)) == v; }
bool is_nan_e4m3(uint8_t b) { return (b & 0x7f) == 0x7f; }

// A bf16 product the kernel rounds (fma.rn.bf16x2 with a -0 addend); the layout's claim is that
// it never has to: the exact f32 product is already a bf16 value.
float bf16_product(float a, float b) {
  const float p = a * b;  // exact in f32 for the operands here (<= 8 + 8 significant bits)
  EXPECT_TRUE(is_bf16(p)) << a << " * " << b;
  return p;
}

// The group scale as the kernel makes it: e4m3 bits as bf16 (e4m3 * 2^-120), times 2^110, twice.
float kernel_scale(uint8_t b) {
  const float placed = bf16_to_f32(static_cast<uint16_t>(e4m3_as_bf16_bits(b)));
  const float k110 = std::ldexp(1.0f, 110);
  return bf16_product(bf16_product(placed, k110), k110);
}

TEST(Nvfp4Layout, TablesAndShiftsTileTheWord) {
  uint32_t covered = 0;
  for (int j = 0; j < 4; ++j) {
    const uint32_t bits = 0x3333u << nvfp4_pair_shift(j);
    EXPECT_EQ(covered & bits, 0u) << "register " << j << " overlaps";
    covered |= bits;
  }
  EXPECT_EQ(covered, 0xffffffffu);
  // Selectors never set a nibble's bit 3 (PRMT's sign-replicate mode).
  for (uint32_t w : {0u, 0xffffffffu, 0x12345678u})
    for (int j = 0; j < 4; ++j) EXPECT_EQ(nvfp4_selector(w, j) & 0x8888u, 0u);
}

TEST(Nvfp4Layout, EveryCodeInEveryPositionDecodesExactly) {
  std::mt19937 rng(7);
  for (int pos = 0; pos < kNvfp4Group; pos += 2)
    for (int lo = 0; lo < 16; ++lo)
      for (int hi = 0; hi < 16; ++hi) {
        uint8_t group[8];
        for (auto& b : group) b = static_cast<uint8_t>(rng());
        group[pos / 2] = static_cast<uint8_t>(lo | (hi << 4));
        uint8_t packed[8];
        nvfp4_pack_codes(group, 1, kNvfp4Group, packed);
        const int w = pos / 8, j = (pos % 8) / 2;  // register j of word w holds codes 8w + 2j, +1
        uint32_t word = 0;
        for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>(packed[4 * w + b]) << (8 * b);
        const uint32_t r = nvfp4_pair_bits(word, j);
        const float got_lo = bf16_to_f32(static_cast<uint16_t>(r & 0xffff));
        const float got_hi = bf16_to_f32(static_cast<uint16_t>(r >> 16));
        ASSERT_EQ(got_lo, std::ldexp(fp4e2m1_to_f32(static_cast<uint8_t>(lo)), -126)) << pos << " " << lo;
        ASSERT_EQ(got_hi, std::ldexp(fp4e2m1_to_f32(static_cast<uint8_t>(hi)), -126)) << pos << " " << hi;
        // A zero code keeps its sign (-0 stays -0): bits, not only values.
        if (lo == 8) {
          EXPECT_EQ(r & 0xffff, 0x8000u);
        }
      }
}

TEST(Nvfp4Layout, EveryScaleAndProductIsExactInBf16) {
  for (int b = 0; b < 256; ++b) {
    if (is_nan_e4m3(static_cast<uint8_t>(b))) continue;
    const float s = kernel_scale(static_cast<uint8_t>(b));
    ASSERT_EQ(s, std::ldexp(fp8e4m3_to_f32(static_cast<uint8_t>(b)), kNvfp4ScaleExp)) << b;
    for (int q = 0; q < 16; ++q) {
      const float code = std::ldexp(fp4e2m1_to_f32(static_cast<uint8_t>(q)), -126);
      const float w = bf16_product(code, s);
      const float want = fp4e2m1_to_f32(static_cast<uint8_t>(q)) * fp8e4m3_to_f32(static_cast<uint8_t>(b));
      ASSERT_EQ(w * kNvfp4GlobalFactor, want) << "code " << q << " scale " << b;
      // Non-zero weights are normal bf16 numbers: the MMA takes them as they are.
      if (want != 0.0f) {
        EXPECT_GE(std::fabs(w), std::ldexp(1.0f, -126));
      }
    }
  }
}

TEST(Nvfp4Layout, ScaleTilesAreABijection) {
  const int64_t rows = 48;
  const int cols = 192;
  std::set<int64_t> seen;
  for (int64_t r = 0; r < rows; ++r)
    for (int g = 0; g < cols / kNvfp4Group; ++g) {
      const int64_t off = nvfp4_packed_scale_offset(r, g, cols);
      ASSERT_GE(off, 0);
      ASSERT_LT(off, rows * cols / kNvfp4Group);
      EXPECT_TRUE(seen.insert(off).second);
    }
  // A 16-row tile's scales of one 64-wide chunk are 64 contiguous bytes, row-major [16][4].
  EXPECT_EQ(nvfp4_packed_scale_offset(16, 4, cols) - nvfp4_packed_scale_offset(16, 0, cols), 64);
  EXPECT_EQ(nvfp4_packed_scale_offset(17, 4, cols) - nvfp4_packed_scale_offset(16, 4, cols), 4);
  EXPECT_FALSE(nvfp4_layout_ok(40, 64));
  EXPECT_FALSE(nvfp4_layout_ok(32, 80));
  EXPECT_TRUE(nvfp4_layout_ok(32, 128));
}

// A random NVFP4 matrix (finite, non-negative scales, as loaders take), its dequantisation by the
// spec, and its codes and scales packed for the kernels.
struct PackedMatrix {
  int rows, cols;
  float global;
  std::vector<uint8_t> codes, scales, pc, ps;
  std::vector<float> spec;
  PackedMatrix(int rows_, int cols_, unsigned seed, float global_) : rows(rows_), cols(cols_), global(global_) {
    std::mt19937 rng(seed);
    codes.resize(static_cast<size_t>(rows) * cols / 2);
    scales.resize(static_cast<size_t>(rows) * (cols / kNvfp4Group));
    for (auto& b : codes) b = static_cast<uint8_t>(rng());
    for (auto& s : scales) {
      do s = static_cast<uint8_t>(rng() & 0x7f);
      while (is_nan_e4m3(s));
    }
    spec.resize(static_cast<size_t>(rows) * cols);
    dequantize_nvfp4(codes.data(), rows, cols, scales.data(), global, spec.data());
    pc.resize(codes.size());
    ps.resize(scales.size());
    nvfp4_pack_codes(codes.data(), rows, cols, pc.data());
    nvfp4_pack_scales(scales.data(), rows, cols, ps.data());
  }
};

// A whole matrix, read back element by element the way the kernel addresses it (row r, 64-wide
// chunk c, lane group c4: bytes of group 4c + c4, word w, register j, half), times the global
// scale the epilogue applies: equal to dequantize_nvfp4 bit for bit.
TEST(Nvfp4Layout, PackedMatrixMatchesTheSpec) {
  const PackedMatrix m(32, 256, 11, 3.0517578e-05f * 1.37f);
  const int rows = m.rows, cols = m.cols;
  const std::vector<uint8_t>&pc = m.pc, &ps = m.ps;
  const std::vector<float>& spec = m.spec;
  const float epilogue = m.global * kNvfp4GlobalFactor;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols / kNvfp4ChunkCols; ++c)
      for (int c4 = 0; c4 < 4; ++c4) {
        const int g = 4 * c + c4;
        const float s = kernel_scale(ps[nvfp4_packed_scale_offset(r, g, cols)]);
        for (int w = 0; w < 2; ++w) {
          const uint8_t* p = pc.data() + static_cast<size_t>(r) * cols / 2 + g * 8 + 4 * w;
          const uint32_t word = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
          for (int j = 0; j < 4; ++j) {
            const uint32_t bits = nvfp4_pair_bits(word, j);
            for (int half = 0; half < 2; ++half) {
              const float code = bf16_to_f32(static_cast<uint16_t>(half ? bits >> 16 : bits & 0xffff));
              const int k = g * kNvfp4Group + 8 * w + 2 * j + half;
              ASSERT_EQ(bf16_product(code, s) * epilogue, spec[static_cast<size_t>(r) * cols + k]) << r << " " << k;
            }
          }
        }
      }
}

// The same matrix read back the way the wgmma GEMM's 4-bit mode addresses it: the stage's code box
// (64 bytes of row r for 128-wide chunk c) and scale box (chunk c's 128 bytes of each 16-row tile),
// one group per k16 step s, lane c4's registers = register c4 of the group's two words, which an
// m64nNk16 wgmma takes as k 2 c4 + half (word 0) and 8 + 2 c4 + half (word 1) of the step.
TEST(Nvfp4Layout, WgmmaStageReadsMatchTheSpec) {
  const PackedMatrix m(48, 384, 23, 0.0123f);
  const int rows = m.rows, cols = m.cols;
  const std::vector<uint8_t>&pc = m.pc, &ps = m.ps;
  const std::vector<float>& spec = m.spec;
  const float epilogue = m.global * kNvfp4GlobalFactor;
  for (int c = 0; c < cols / 128; ++c) {
    // The scale box of chunk c: 128 bytes per row tile, bytes [tile * cols + 128 c, + 128).
    std::vector<uint8_t> box(static_cast<size_t>(rows / 16) * 128);
    for (int t = 0; t < rows / 16; ++t)
      for (int i = 0; i < 128; ++i) box[t * 128 + i] = ps[static_cast<size_t>(t) * cols + 128 * c + i];
    for (int r = 0; r < rows; ++r)
      for (int s = 0; s < 8; ++s) {
        const float sc = kernel_scale(box[(r / 16) * 128 + nvfp4_chunk128_scale_byte(r % 16, s)]);
        for (int w = 0; w < 2; ++w) {
          const uint8_t* p = pc.data() + static_cast<size_t>(r) * cols / 2 + 64 * c + 8 * s + 4 * w;
          const uint32_t word = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
          for (int c4 = 0; c4 < 4; ++c4) {
            const uint32_t bits = nvfp4_pair_bits(word, c4);
            for (int half = 0; half < 2; ++half) {
              const float code = bf16_to_f32(static_cast<uint16_t>(half ? bits >> 16 : bits & 0xffff));
              const int k = 128 * c + 16 * s + 8 * w + 2 * c4 + half;
              ASSERT_EQ(bf16_product(code, sc) * epilogue, spec[static_cast<size_t>(r) * cols + k]) << r << " " << k;
            }
          }
        }
      }
  }
}

}  // namespace
}  // namespace moelora::cuda_plan
