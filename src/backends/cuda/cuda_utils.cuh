// Device-side helpers shared by the CUDA kernels: bf16/fp8 packing, warp reductions, the bf16
// tensor-core MMA and wide loads. Include from .cu files only (device code); the launch headers
// (kernels/*.cuh) stay includable from plain C++.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/launch.cuh"

namespace moelora::cuda {

using bf16 = __nv_bfloat16;


__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- bf16 <-> f32 (bit-exact: bf16 is the upper half of an f32; packing rounds to nearest even,
// which is what core/dtype.h's f32_to_bf16 does for every finite value).
__device__ __forceinline__ float bf16_bits_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_bits_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf16_to_float(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint16_t bf16_bits(float v) {
  bf16 h = __float2bfloat16_rn(v);
  return *reinterpret_cast<uint16_t*>(&h);
}

// ---- fp8 e4m3 -> bf16, exact. Two bytes (in bits 0-7 and 16-23 of `v`) become a bf16x2 whose
// exponent field holds the e4m3 exponent unbiased by 120 and whose mantissa holds the 3 bits; one
// bf16x2 multiply by 2^120 then gives the exact value, e4m3 subnormals included (they arrive as
// bf16 subnormals; bf16 multiplication keeps subnormals). The e4m3 NaN code (0x7f) decodes to 480:
// weights never hold NaN. tests/ops checks all 256 codes against core/dtype.h.
__device__ __forceinline__ uint32_t fp8x2_spread_to_bf16x2(uint32_t v) {
  const uint32_t bits = ((v << 8) & 0x80008000u) | ((v << 4) & 0x07f007f0u);
  __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80));
  h = __hmul2(h, k);
  return *reinterpret_cast<uint32_t*>(&h);
}
// Bytes 0,1 of `w` -> bf16x2 (lo, hi); bytes 2,3 -> second bf16x2.
__device__ __forceinline__ void fp8x4_to_bf16x2x2(uint32_t w, uint32_t& lo01, uint32_t& hi23) {
  lo01 = fp8x2_spread_to_bf16x2(__byte_perm(w, 0u, 0x4140));
  hi23 = fp8x2_spread_to_bf16x2(__byte_perm(w, 0u, 0x4342));
}

// ---- Warp reductions.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- Tensor cores: D = A(16x16, row) * B(16x8, col) + C, bf16 in, f32 accumulate.
// Fragment ownership (lane = 4*g + t): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
// a3 = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c0,c1 = C[g][2t..2t+1],
// c2,c3 = C[g+8][2t..2t+1]. A contraction over k may permute k freely as long as A and B agree;
// the kernels use that to give each lane contiguous runs of memory (see dense_gemm.cu).
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- Shared memory: cp.async and ldmatrix.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// cp.async of SZ bytes (4, 8 or 16; 16 goes through L2 only); pred false writes zeros and reads
// nothing (`gmem` must still be a valid address expression: callers pass a base pointer).
template <int SZ>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool pred) {
  const unsigned s = smem_addr(smem);
  const int src = pred ? SZ : 0;
  if constexpr (SZ == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(gmem), "n"(SZ), "r"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- Loads. Read-only data (weights, activations of this launch) goes through the
// non-coherent path; `pred` false gives zeros without touching memory.
__device__ __forceinline__ uint4 ldg_u4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 ldg_u4_pred(const void* p, bool pred) {
  return pred ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ uint2 ldg_u2_pred(const void* p, bool pred) {
  return pred ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
}
// Streaming load (weights read once per launch): do not keep in L1.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ld_stream_u4_pred(const void* p, bool pred) {
  return pred ? ld_stream_u4(p) : make_uint4(0u, 0u, 0u, 0u);
}

// Row of position `pos` in a paged KV cache of `page_size` positions per page, for the sequence
// whose page list starts at `pages` (its CSR slice of the page table).
__device__ __forceinline__ int64_t paged_cache_row(const int32_t* pages, int page_size, int pos) {
  const int pi = pos / page_size;
  return static_cast<int64_t>(pages[pi]) * page_size + (pos - pi * page_size);
}

// A uint4 seen as 8 bf16 -> 8 floats (exact).
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) f[2 * i] = bf16_bits_lo(w[i]), f[2 * i + 1] = bf16_bits_hi(w[i]);
}

// Element i (0..7) of a uint4 seen as 8 bf16.
__device__ __forceinline__ float u4_bf16(const uint4& v, int i) {
  const uint32_t w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
  return (i & 1) ? bf16_bits_hi(w) : bf16_bits_lo(w);
}

}  // namespace moelora::cuda
