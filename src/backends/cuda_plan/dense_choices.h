// Per-shape choices of the CUDA dense projection and decode attention kernels, made on the host
// from the problem alone (tests/cuda_plan checks them without a GPU). The kernel files launch what
// is chosen here; each threshold cites the measurement it comes from (bench/RESULTS.md).
#pragma once

#include <array>
#include <cstdint>

namespace moelora::cuda_plan {

// ---- Dense projection y = x W^T (kernels/dense_gemm.cu).
enum class DensePath {
  kSmallM,    // our memory-bound small-M kernel (decode)
  kCublasLt,  // cuBLASLt (bf16 GEMM, or FP8 block-scaled after quantising the activations)
};
// How the weight is stored on the device.
enum class DenseWeights { kBf16, kFp8, kNvfp4 };
// For NVFP4, kCublasLt means: the weight dequantised to bf16 in step scratch, then cuBLASLt's bf16
// GEMM (no FP4 GEMM exists on Hopper).
DensePath choose_dense_path(int M, DenseWeights w);
// The small-M kernel's lanes read 32-value runs of a weight row: input widths it takes (others go
// to the naive kernel; NVFP4 projections of other widths are uploaded as bf16).
inline constexpr int kDenseSmallMInMultiple = 32;
// NVFP4 on the cuBLASLt path: rows of the weight dequantised (and multiplied) per pass, a multiple
// of 8 (16-byte aligned output columns) whose bf16 copy stays within kNvfp4DequantChunkBytes, so a
// prefill step's scratch is bounded whatever the projection (DeepSeek-V3's fused dense gate|up
// would need 528 MB at once).
inline constexpr int64_t kNvfp4DequantChunkBytes = int64_t{64} << 20;
int nvfp4_dequant_chunk_rows(int out, int in);

// Tiling of the small-M kernel: `m_tiles` 8-token tiles per block (1, 2, 4 or 8), `row_groups`
// 16-row weight tiles per block and `k_warps` warps splitting K (row_groups * k_warps <= 8).
struct DenseSmallMTiling {
  int m_tiles = 1;
  int row_groups = 1;
  int k_warps = 1;
};
// `in` is the reduction length; row_groups / k_warps > 0 force those values (the workbench sweeps
// them), 0 = the measured default.
DenseSmallMTiling choose_dense_small_m_tiling(int M, int in, int row_groups = 0, int k_warps = 0);

// ---- Which attention kernels run a model's heads (kernels/attention.cu dispatch).
// The tensor-core kernels (prefill in attention.cu, decode in attention_decode.cu) are instantiated
// for the (k, v) head-dim pairs below; any other pair with k a multiple of 8 and both at most
// kGenericAttentionMaxDim runs the generic kernel (attention_generic.cu: one warp per (token, head)
// on the CUDA cores, f32), which is correct for every shape but not fast: a model whose heads need it
// says so at load (docs/gpu.md).
struct HeadDims {
  int k, v;
};
inline constexpr std::array<HeadDims, 6> kTensorCoreHeadDims = {
    HeadDims{32, 32}, HeadDims{48, 32}, HeadDims{48, 48}, HeadDims{64, 64}, HeadDims{128, 128}, HeadDims{192, 128}};
inline constexpr int kGenericAttentionMaxDim = 256;
enum class AttentionKernel {
  kTensorCore,   // attention.cu prefill + attention_decode.cu decode
  kGeneric,      // attention_generic.cu, every token
  kUnsupported,  // no kernel: check_shape_limits refuses the model
};
AttentionKernel choose_attention_kernel(int k_head_dim, int v_head_dim);
// Some kernel runs these head dims.
inline bool attention_head_dims_supported(int k_head_dim, int v_head_dim) {
  return choose_attention_kernel(k_head_dim, v_head_dim) != AttentionKernel::kUnsupported;
}

// ---- Prefill attention on the tensor cores: which kernel, and how many (token, head) rows a block
// takes. kMmaSync (attention.cu): 4 warps x 16 rows, each warp reading its K/V rows from global
// memory itself (54 TFLOP/s on a 4k prompt, H200 2026-12-03). kWgmma
// (attention_prefill_wgmma.cu): 2 warpgroups x 64 rows sharing 64-position K/V tiles that
// cp.async stages in shared memory, Q K^T and P V as wgmmas; built for head dims that are
// multiples of 64 (its operands are 64-wide swizzle columns) where kTensorCoreHeadDims has them.
enum class AttentionPrefillKernel { kMmaSync, kWgmma };
inline constexpr int kAttentionPrefillRowsMmaSync = 64;
inline constexpr int kAttentionPrefillRowsWgmma = 128;
bool attention_prefill_wgmma_built(int k_head_dim, int v_head_dim);
// kWgmma wherever it is built: measured (H100, 2026-12-05, dev_attention prefill, Qwen3-30B heads
// 32/4 x 128; bench/RESULTS.md) a 4096-token causal prompt 2531 -> 568 us (54 -> 242 TFLOP/s), 512
// after 4096 cached 609 -> 141 us, 1024 tokens 248 -> 68 us, 4096 after 4096 7480 -> 1501 us; op
// suite, memcheck and racecheck clean. AttentionPlanOptions::prefill_kernel still forces either.
AttentionPrefillKernel choose_attention_prefill(int k_head_dim, int v_head_dim);
inline int attention_prefill_rows(AttentionPrefillKernel k) {
  return k == AttentionPrefillKernel::kWgmma ? kAttentionPrefillRowsWgmma : kAttentionPrefillRowsMmaSync;
}

// ---- Decode attention (kernels/attention_decode.cu): split over the KV positions, pipeline depth.
// A token's positions are cut into splits of whole 64-position pieces, at least
// kAttentionMinSplitPositions each; how many is decided per token on the device from its own
// length (`attention_token_split`), so a graph captured with the largest grid still spreads a short
// context over the blocks it launches.
constexpr int kAttentionMinSplitPositions = 128;
// At most this many splits (the combine kernel keeps one weight per split in shared memory); the
// plan's "fill the GPU twice" rule asks for at most 2 x num_sms.
constexpr int kAttentionMaxSplits = 512;
// Query heads of one KV head that a block takes: 8 (one MMA column tile) or 16.
inline int attention_decode_heads_per_block(int group) { return group <= 8 ? 8 : 16; }
// Dynamic shared memory of a decode block: 4 warps x `stages` tiles of 16 positions of K and V in
// rows padded by 8 values, or the warps' merge area if larger. The kernel allocates exactly this
// (constexpr: it static_asserts that its layout fits).
constexpr int attention_decode_smem_bytes(int k_head_dim, int v_head_dim, int heads_per_block, int stages) {
  constexpr int kWarps = 4, kTile = 16;
  const int pipe = stages * kWarps * kTile * (k_head_dim + 8 + v_head_dim + 8) * 2;
  const int merge = kWarps * heads_per_block * (v_head_dim + 4) * 4 + 2 * kWarps * heads_per_block * 4;
  return pipe > merge ? pipe : merge;
}
struct AttentionDecodeSplit {
  int max_splits = 1;  // splits of the longest sequence (the grid's extent)
  int stages = 2;      // K/V tiles per warp in shared memory (in flight + the one being used)
};
// T tokens (one per sequence), kv_heads KV heads with `group` query heads each, the longest
// context `max_positions`, head dims (k, v), on a GPU of `num_sms` SMs.
AttentionDecodeSplit choose_attention_decode_split(int T, int kv_heads, int group, int max_positions, int num_sms,
                                                   int k_head_dim, int v_head_dim);

// Splits of one token of `n` positions when the grid has `max_splits`: `count` splits of `chunk`
// positions (a multiple of 64; the last one shorter), none empty. Host and device agree on it.
struct AttentionTokenSplit {
  int chunk;
  int count;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
inline AttentionTokenSplit attention_token_split(int n, int max_splits) {
  int want = (n + kAttentionMinSplitPositions - 1) / kAttentionMinSplitPositions;
  want = want < 1 ? 1 : want;
  const int ns = max_splits < want ? max_splits : want;
  const int chunk = ((n + ns - 1) / ns + 63) / 64 * 64;
  return {chunk, (n + chunk - 1) / chunk};
}

}  // namespace moelora::cuda_plan
