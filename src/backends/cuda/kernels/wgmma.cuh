// Hopper warpgroup MMA (wgmma, sm_90a) in PTX: shared-memory matrix descriptors, the fences and
// the bf16 MMAs with A in registers, shared by the grouped expert GEMM (moe_gemm_wgmma.cu) and the
// prefill attention (attention_prefill_wgmma.cu). Both write their shared-memory operands in the
// 128-byte swizzle: 8-row atoms of 128-byte rows (1024 bytes, 1024-aligned), 16-byte unit u of
// row r stored at unit u ^ (r % 8) (cuda_plan/sw128_layout.h states it and what these descriptors
// read; tests/cuda_plan checks the two against each other).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Orders this thread's generic-proxy writes to shared memory (st.shared, completed cp.async)
// before later async-proxy reads (wgmma operands, TMA stores).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Matrix descriptor of a K-major operand in the 128-byte swizzle: rows of 128 bytes, 8-row atoms
// 1024 bytes apart (stride byte offset); the leading byte offset is unused for this layout.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Matrix descriptor of an MN-major operand (B with TRANS_B = 1: N contiguous) in the 128-byte
// swizzle. The canonical layout, in 16-byte units, is ((8, n), (8, k)) : ((1, LBO), (8, SBO)):
// 64 bf16 of N per 128-byte row, one row per k, 8 rows per atom; atoms along k `SBO` = 1024 bytes
// apart, 64-wide N blocks `n_block_bytes` apart (the leading byte offset).
__device__ __forceinline__ uint64_t desc_mn_sw128(uint32_t smem_addr, uint32_t n_block_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((n_block_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Pins registers that wgmma reads or writes asynchronously (accumulators, A fragments) at this
// point of the instruction stream: the fence / commit / wait asm only clobbers memory, so without
// these the compiler may move ordinary reads or writes of those registers across them (CUTLASS
// calls the same idea warpgroup_fence_operand). Place them after a wait and before a fence.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// D(64 x BN, f32) (+)= A(64 x 16, bf16, registers) * B(16 x BN, bf16, shared memory): K-major
// (desc_sw128) when TRANS_B is 0, N-major (desc_mn_sw128) when 1. The accumulator is overwritten
// when `accumulate` is 0. Fragments: A as mma.m16n8k16's per warp (warp w of the warpgroup holds
// rows 16w..16w+15); d[4j + e] is row 16w + g + 8 (e / 2), column 8j + 2t + e % 2 (g = lane / 4,
// t = lane % 4).
template <int BN, int TRANS_B = 0>
struct Wgmma;
template <int TRANS_B>
struct Wgmma<8, TRANS_B> {
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, %10;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
  }
};
template <int TRANS_B>
struct Wgmma<16, TRANS_B> {
  __device__ __forceinline__ static void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, "
        "1, %14;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
  }
};
template <int TRANS_B>
struct Wgmma<32, TRANS_B> {
  __device__ __forceinline__ static void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1, %22;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
  }
};
template <int TRANS_B>
struct Wgmma<64, TRANS_B> {
  __device__ __forceinline__ static void mma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
  }
};

}  // namespace moelora::cuda::sm90
