// Dense projections y = x W^T for bf16 activations and FP8 (e4m3, 128x128 block scales), NVFP4 or
// bf16 weights [out, in] (LinearWeight on the GPU).
//
// Paths
// - Small M (decode, M <= kDenseSmallMMax): our memory-bound tensor-core kernel. It reads every
//   weight byte once, turns FP8 into bf16 in registers (exact), multiplies with the bf16
//   activations on the tensor cores and applies each 128x128 block scale to the f32 partial sum of
//   its block: W8A16, no activation quantisation error. NVFP4 (W4A16): each lane's 32-value run of
//   a K block is two 16-value groups, turned into bf16 times their group scales exactly in
//   registers (nvfp4_device.cuh); the per-row global scale multiplies the f32 sums.
// - NVFP4 beyond the small-M range: the weight is dequantised into step scratch as bf16 (exactly
//   what a bf16 upload of it holds) and multiplied by cuBLASLt's bf16 GEMM.
// - Large M (prefill): cuBLASLt. FP8 weights: activations quantised per token per 128 channels
//   (fp8_quant.cuh, scales [K/128][M]) and the block-scaled FP8 GEMM (D^T = W X^T, weight as A with
//   BLK128x128 scales, activations as B with VEC128 scales). bf16 weights: a bf16 GEMM.
// dense_linear() picks the path; DenseGemmContext owns the cuBLASLt handle and workspace, made once
// up front, so that launches allocate nothing and can be captured in CUDA graphs.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>

#include "backends/cuda/kernels/dense_lora_epilogue.cuh"
#include "backends/cuda_plan/dense_choices.h"

namespace moelora::cuda {

enum class WeightType : uint8_t { kBF16, kFP8E4M3, kNvfp4 };

// A projection's weight as the kernels see it (mirrors LinearWeight).
struct DenseWeight {
  const void* w = nullptr;  // [out, in] row-major, contiguous
  WeightType type = WeightType::kBF16;
  int out = 0;
  int in = 0;
  const float* scale_inv = nullptr;  // FP8: [row_blocks, ceil(in / block_in)]
  int block_out = 128;
  int block_in = 128;  // FP8 paths need 128
  int split_rows = 0;  // see LinearWeight::split_rows
  // NVFP4: w holds the codes [out, in / 2] in cuda_plan/nvfp4_layout.h's order, group_scale the
  // e4m3 group scales row-major [out, in / 16], global_scale weight_scale_2 * 2^26 per row [out]
  // (rows of fused parts keep their part's).
  const uint8_t* group_scale = nullptr;
  const float* global_scale = nullptr;
};

struct DenseArgs {
  const __nv_bfloat16* x = nullptr;  // [M, in], row stride ld_x
  int64_t ld_x = 0;
  int M = 0;
  DenseWeight w;
  __nv_bfloat16* y = nullptr;  // [M, out] bf16, or
  float* y_f32 = nullptr;      // [M, out] f32 (final logits); exactly one of y / y_f32
  int64_t ld_y = 0;
  // Per-token LoRA added before the output's rounding (lora.u set: its shrink ran before;
  // dense_lora_epilogue.cuh). The small-M and naive kernels take it; cuBLASLt does not.
  DenseLoraEpilogue lora;
};

// The small-M kernel's design range (one grid row of 8 token tiles); it is correct for any M.
constexpr int kDenseSmallMMax = 64;

// Tiling of the small-M kernel: `row_groups` 16-row tiles per block and `k_warps` warps splitting K
// (row_groups * k_warps <= 8). 0 = the heuristic (dense_gemm.cu).
struct DenseSmallMConfig {
  int row_groups = 0;
  int k_warps = 0;
};
// Any M works (tokens beyond 64 go to further grid rows); the kernel is built for M <= 64.
// Shapes it cannot take (in % 32 != 0, unaligned rows, FP8 with block_in != 128) go to the naive
// kernel below.
void launch_dense_small_m(const DenseArgs& a, cudaStream_t stream, DenseSmallMConfig cfg = {});
// The plain reference kernel: one warp per output element, f32 dot products. For checks and odd
// shapes only.
void launch_dense_naive(const DenseArgs& a, cudaStream_t stream);

// Scratch that dense_linear needs for FP8 prefill (quantised activations + their scales).
struct DenseScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};
size_t dense_fp8_scratch_bytes(int max_M, int in);
// Scratch for an NVFP4 weight dequantised to bf16 (the path above the small-M range): the rows of
// one pass (cuda_plan::nvfp4_dequant_chunk_rows); a smaller scratch of at least 8 rows works in
// more passes.
size_t dense_nvfp4_scratch_bytes(int out, int in);
// The NVFP4 weight `w` as bf16 [out, in] into `out` (16-byte aligned): e2m1 x e4m3 x global in
// f32, rounded to bf16 (as the host's dequantisation for a bf16 upload). Graph-safe.
void launch_nvfp4_dequant(const DenseWeight& w, __nv_bfloat16* out, cudaStream_t stream);

class DenseGemmContext {
 public:
  // Creates the cuBLASLt handle and its workspace (cudaMalloc): call once, outside any capture.
  explicit DenseGemmContext(size_t lt_workspace_bytes = size_t{32} << 20);
  ~DenseGemmContext();
  DenseGemmContext(const DenseGemmContext&) = delete;
  DenseGemmContext& operator=(const DenseGemmContext&) = delete;

  // cuBLASLt block-scaled FP8 GEMM on already-quantised activations xq [M, in] (row stride ld_q
  // bytes) with scales [ceil(in/128)][M] (token fastest). False when cuBLASLt has no algorithm
  // for the shape (the caller falls back); nothing was launched then.
  bool gemm_fp8(const DenseArgs& a, const uint8_t* xq, int64_t ld_q, const float* x_scales, cudaStream_t stream);
  // cuBLASLt bf16 GEMM (f32 accumulate). False when unsupported (nothing launched).
  bool gemm_bf16(const DenseArgs& a, cudaStream_t stream);

 private:
  struct Algo {
    bool ok = false;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::array<int64_t, 10>;
  // The heuristic's algorithm for a shape, asked once (std::map keeps references stable).
  Algo& algo_for(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                 cublasLtMatrixLayout_t ld);
  // False (nothing launched, shape remembered as unsupported) when cuBLASLt refuses at launch.
  bool launch(Algo& algo, cublasLtMatmulDesc_t op, const void* A, cublasLtMatrixLayout_t la, const void* B,
              cublasLtMatrixLayout_t lb, void* D, cublasLtMatrixLayout_t ld, cudaStream_t stream);

  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Algo> algos_;  // heuristic answer per shape (host-only work, done once)
};

// The dispatcher: our small-M kernel up to M = 32 (FP8) / 8 (bf16), the crossovers measured on
// the H200, and up to cuda_plan's NVFP4 limit; above, FP8 -> quantise the first M - M % 4 tokens
// into `scratch` + ctx.gemm_fp8 (the last M % 4 tokens through our kernel), bf16 -> ctx.gemm_bf16,
// NVFP4 -> dequantise into `scratch` + ctx.gemm_bf16. Where cuBLASLt declines a shape
// (FP8: column blocks not a multiple of 4, odd splits) or `scratch` is too small, our kernel does
// all M. Graph-safe given ctx and scratch made beforehand.
void dense_linear(DenseGemmContext& ctx, const DenseArgs& a, DenseScratch scratch, cudaStream_t stream);
// The path dense_linear takes for M tokens of a weight of this type (cuda_plan::choose_dense_path).
cuda_plan::DensePath dense_path(int M, WeightType t);

}  // namespace moelora::cuda
