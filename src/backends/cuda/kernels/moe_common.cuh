// Shared device helpers of the MoE kernels (router, alignment, grouped GEMMs, MoE LoRA):
// bf16/fp8 conversions, the warp-level bf16 tensor-core MMA, cp.async, programmatic dependent
// launch (PDL) and a launch helper. Kept here (not in a project-wide header) so the MoE kernels
// depend on nothing another engineer is editing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/launch.cuh"

namespace moelora::cuda {

using bf16 = __nv_bfloat16;

// One row block of a grouped GEMM or a LoRA group: `count` consecutive entries of a sorted index
// list starting at `start`, all routed to `expert` (and adapter `slot` for LoRA; -1 = none).
// Base tiles have slot = 0. LoRA "token" tiles (shared-A shrink) have expert = -1.
struct MoeTile {
  int32_t expert;
  int32_t start;
  int32_t count;
  int32_t slot;
};

namespace moe_detail {

// Programmatic dependent launch: pdl_wait / pdl_trigger and launch_kernel (backends/cuda/launch.cuh).
// Every MoE kernel waits before its first global write and before reading anything its
// predecessor writes, and triggers its dependents right after the wait: so a kernel's dependent can
// rely on everything two launches back being complete (the down GEMM uses that to prefetch weights
// early).

// ---- bf16 helpers
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// 8 bf16 in a uint4 -> 8 floats (exact).
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x);
  f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
  f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z);
  f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ---- FP8 e4m3 -> bf16, exact, in registers.
// A byte b = s.eeee.mmm placed as bf16 bits (s << 15) | (eeee.mmm << 4) is the bf16 number
// b * 2^-120 (exponent bias 127 instead of 7; e = 0 lands on bf16 subnormals, which is exactly
// the e4m3 subnormal rule). One bf16x2 multiply by 2^120 (exact: a power of two, result normal)
// restores the value. Checked against fp8e4m3_to_f32 for all 254 non-NaN codes.
// Returns (b0, b1) in `lo` and (b2, b3) in `hi`, element 0 in the low half of each register.
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t t0 = __byte_perm(w, 0u, 0x1404);  // lanes: b0 << 8, b1 << 8
  const uint32_t t1 = __byte_perm(w, 0u, 0x3424);  // lanes: b2 << 8, b3 << 8
  const uint32_t r0 = (t0 & 0x80008000u) | ((t0 & 0x7f007f00u) >> 4);
  const uint32_t r1 = (t1 & 0x80008000u) | ((t1 & 0x7f007f00u) >> 4);
  const uint32_t k2p120 = 0x7b807b80u;  // bf16x2 (2^120, 2^120)
  const uint32_t neg0 = 0x80008000u;    // -0: x * s + (-0) keeps the sign of zero
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(lo) : "r"(r0), "r"(k2p120), "r"(neg0));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(hi) : "r"(r1), "r"(k2p120), "r"(neg0));
}

// ---- Warp MMA: D(16x8, f32) += A(16x16, bf16, row) * B(16x8, bf16, col).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- Warp MMA: D(16x8, f32) += A(16x32, e4m3, row) * B(32x8, e4m3, col) (sm_89+). Each
// register holds 4 consecutive k of one row (A: a0/a2 row g, a1/a3 row g + 8; k 4c..4c+3 in a0,
// a1, b0 and 16 + 4c.. in a2, a3, b1; B: column g). Products of e4m3 values are exact in f32.
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- cp.async (16 bytes, L2 only: streamed weights must not evict L1-resident indices).
// pred = false zero-fills the destination without reading `src` (which must still be a valid
// address expression; callers pass a base pointer).
__device__ __forceinline__ void cp_async16(void* smem, const void* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n) : "memory");
}
// 4 bytes through L1 (cp.async.cg only takes 16): the per-token activation scales of a tile.
__device__ __forceinline__ void cp_async4(void* smem, const void* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Warms L2 with the 128-byte line holding `p` (no register or shared-memory cost).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// Read-only 16-byte load through the non-coherent path (data no kernel writes while it runs).
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix sum of one int per thread over a block of blockDim.x (multiple of 32, <= 1024)
// threads. `scratch` holds 33 ints of shared memory. Returns the thread's prefix; *total gets the
// block sum. Contains __syncthreads (all threads must call it).
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += n;
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int warp_base = warp > 0 ? scratch[warp - 1] : 0;
  *total = scratch[nwarps - 1];
  __syncthreads();  // scratch may be reused right after
  return warp_base + inc - v;
}

}  // namespace moe_detail

// Launches `kernel<<<grid, block, smem, stream>>>(params)`, with the programmatic-dependent-launch
// attribute when `pdl` (graph capture turns it into a programmatic edge). Checked.
template <typename Params>
inline void moe_launch(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                       const Params& p) {
  launch_kernel(kernel, grid, block, smem, stream, pdl, p);
}

// Number of SMs of the current device (cached; the process uses one device).
int moe_num_sms();

}  // namespace moelora::cuda
