// NVFP4 weights in registers: the device half of cuda_plan/nvfp4_layout.h (which explains the
// packed order and why each step is exact; tests/cuda_plan/nvfp4_layout_test.cpp checks the same
// steps on the CPU against the spec). Used by the grouped MoE GEMMs (moe_gemm.cu) and the dense
// small-M GEMM (dense_gemm.cu), whose lanes both hold whole 16-value groups of a weight row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda_plan/nvfp4_layout.h"

namespace moelora::cuda {

// bf16x2 a * b (fma with a -0 addend, which keeps the sign of zero products); exact for the
// operands below (products of at most 2 + 4 significant bits, or powers of two).
__device__ __forceinline__ uint32_t nvfp4_bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}

// The register whose selector bits start at `shift` (cuda_plan::nvfp4_pair_shift(j)) of a packed
// code word: codes 2j, 2j + 1 of the word as bf16 e2m1 * 2^-126 (one PRMT through the two tables).
__device__ __forceinline__ uint32_t nvfp4_pair_at(uint32_t word, int shift) {
  return __byte_perm(cuda_plan::kNvfp4LoTable, cuda_plan::kNvfp4HiTable, cuda_plan::nvfp4_selector_at(word, shift));
}
// Register j (0..3) of a packed code word.
__device__ __forceinline__ uint32_t nvfp4_pair(uint32_t word, int j) {
  return nvfp4_pair_at(word, cuda_plan::nvfp4_pair_shift(j));
}

// Two e4m3 group scales (low, high half) as bf16 e4m3 * 2^100: placed as e4m3 * 2^-120, then
// times 2^110 twice (each product exact and normal).
__device__ __forceinline__ uint32_t nvfp4_scales_bf16x2(uint32_t b_lo, uint32_t b_hi) {
  static_assert(cuda_plan::kNvfp4ScaleExp == -120 + 2 * 110, "scale exponent");
  const uint32_t placed = cuda_plan::e4m3_as_bf16_bits(b_lo) | (cuda_plan::e4m3_as_bf16_bits(b_hi) << 16);
  constexpr uint32_t k2p110 = 0x76807680u;  // bf16x2 (2^110, 2^110)
  return nvfp4_bf16x2_mul(nvfp4_bf16x2_mul(placed, k2p110), k2p110);
}

// The low / high half of a bf16x2 in both halves.
__device__ __forceinline__ uint32_t bf16x2_dup_lo(uint32_t v) { return __byte_perm(v, 0u, 0x1010); }
__device__ __forceinline__ uint32_t bf16x2_dup_hi(uint32_t v) { return __byte_perm(v, 0u, 0x3232); }

// The MMA registers of one lane's 16-value group of one row: register 2s' + h (s' = 0..3, h = 0, 1)
// holds k 4s' + 2h, +1 of the group times its scale (`scale2`: the scale' in both halves), i.e. an
// m16n8k16 step's a0 (h = 0) and a2 (h = 1) for the row. `w0`, `w1`: the group's two packed words.
__device__ __forceinline__ void nvfp4_group_regs(uint32_t w0, uint32_t w1, uint32_t scale2, uint32_t (&r)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = nvfp4_bf16x2_mul(nvfp4_pair(i < 4 ? w0 : w1, i & 3), scale2);
}

}  // namespace moelora::cuda
