// The routed experts' grouped GEMMs for shapes the tensor-core kernels do not take (moe_gemm.cuh;
// cuda_plan::choose_moe_tuning sets MoeTuning::generic when H or I is not a multiple of 64): any H
// and I that are multiples of 16, FP8 block-scaled (partial edge blocks included) or bf16 experts.
// Same tiles, same outputs, same epilogues as moe_gemm.cu, so the rest of the layer (alignment,
// LoRA, reduction) is untouched.
//
// One warp per (tile, output feature): the warp's lanes split the K axis, every weight element is
// dequantised exactly (e4m3 x its block's scale) and multiplied in f32, and one warp sum per
// (pair, feature) gives the result; lane 0 writes it. The tile's rows reread the same weight row
// from L1. Correctness for any shape is its job, not speed: the shapes it serves are the ones no
// tensor-core tile fits (docs/gpu.md).
#include <cuda_fp8.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/moe_gemm.cuh"

namespace moelora::cuda {
namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

// Element k of weight row `row` (of K elements), dequantised: FP8 codes times their 128 x 128
// block's scale (scale row `srow` of ceil(K/128) columns), or bf16.
template <bool kFp8>
__device__ __forceinline__ float weight_at(const MoeGemmParams& p, int64_t row, int K, const float* srow, int k) {
  if constexpr (kFp8) {
    return e4m3_to_float(static_cast<const uint8_t*>(p.w)[row * K + k]) * srow[k / 128];
  } else {
    return bf16_to_float(static_cast<const bf16*>(p.w)[row * K + k]);
  }
}

// This warp's (tile, output feature) of a grid of [max_tiles, ceil(outputs / kWarps)] blocks, after
// the PDL wait (before anything is read); false when there is none (past the tiles moe_align wrote
// or past the outputs: whole warps, no block-level synchronisation follows).
__device__ __forceinline__ bool warp_item(const MoeGemmParams& p, int outputs, int& tile, int& feature) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  tile = blockIdx.x;
  feature = blockIdx.y * kWarps + static_cast<int>(threadIdx.x >> 5);
  return tile < p.counters[kMoeCntTiles] && feature < outputs;
}

// gate_up: act[p, f] = silu(g + dg) * (u + du), g / u = x[p / top_k] . W rows (e*2I + f, e*2I + I + f).
template <bool kFp8>
__global__ void __launch_bounds__(kWarps * 32) moe_gate_up_generic_kernel(const __grid_constant__ MoeGemmParams p) {
  int tile, f;
  if (!warp_item(p, p.I, tile, f)) return;
  const int lane = threadIdx.x & 31;
  const int H = p.H, I = p.I, e = p.tiles[tile].expert;
  const int64_t row_g = static_cast<int64_t>(e) * 2 * I + f, row_u = row_g + I;
  const float *s_g = nullptr, *s_u = nullptr;
  if constexpr (kFp8) {
    const int kb = ceil_div(H, 128), ib = ceil_div(I, 128);  // per expert: ib gate row blocks, then ib up
    s_g = p.w_scale + (static_cast<int64_t>(e) * 2 * ib + f / 128) * kb;
    s_u = p.w_scale + (static_cast<int64_t>(e) * 2 * ib + ib + f / 128) * kb;
  }
  for (int m = 0; m < p.align_tile_rows; ++m) {
    const int pair = p.tile_pairs[static_cast<int64_t>(tile) * p.align_tile_rows + m];
    if (pair < 0) continue;  // tile padding (warp-uniform)
    const bf16* x = p.x + static_cast<int64_t>(pair / p.top_k) * p.ldx;
    float g = 0.0f, u = 0.0f;
    for (int k = lane; k < H; k += 32) {
      const float xv = bf16_to_float(x[k]);
      g = fmaf(xv, weight_at<kFp8>(p, row_g, H, s_g, k), g);
      u = fmaf(xv, weight_at<kFp8>(p, row_u, H, s_u, k), u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) {
      const int64_t pr = pair;
      if (p.lora_delta) {
        const bf16* d = p.lora_delta + pr * 2 * I + f;
        g += bf16_to_float(d[0]);
        u += bf16_to_float(d[I]);
      } else if (p.lora_gu.token_slot) {
        float dg, du;
        moe_lora_gate_up_delta(p.lora_gu, pr, e, I, f, dg, du);
        g += dg;
        u += du;
      }
      p.act[pr * I + f] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
    }
  }
}

// down: y[p, h] = act[p] . W row (e*H + h).
template <bool kFp8>
__global__ void __launch_bounds__(kWarps * 32) moe_down_generic_kernel(const __grid_constant__ MoeGemmParams p) {
  int tile, h;
  if (!warp_item(p, p.H, tile, h)) return;
  const int lane = threadIdx.x & 31;
  const int H = p.H, I = p.I, e = p.tiles[tile].expert;
  const int64_t row = static_cast<int64_t>(e) * H + h;
  const float* s = nullptr;
  if constexpr (kFp8) s = p.w_scale + (static_cast<int64_t>(e) * ceil_div(H, 128) + h / 128) * ceil_div(I, 128);
  for (int m = 0; m < p.align_tile_rows; ++m) {
    const int pair = p.tile_pairs[static_cast<int64_t>(tile) * p.align_tile_rows + m];
    if (pair < 0) continue;
    const bf16* a = p.x + static_cast<int64_t>(pair) * p.ldx;
    float acc = 0.0f;
    for (int k = lane; k < I; k += 32) acc = fmaf(bf16_to_float(a[k]), weight_at<kFp8>(p, row, I, s, k), acc);
    acc = warp_sum(acc);
    if (lane == 0) p.y[static_cast<int64_t>(pair) * H + h] = acc;
  }
}

void check_generic(const MoeGemmParams& p, bool gate_up) {
  MOELORA_CHECK_MSG(p.H > 0 && p.I > 0 && p.E >= 1 && p.w && p.tile_pairs && p.tiles && p.counters && p.x,
                    "generic MoE GEMM: incomplete parameters (H {}, I {}, E {})", p.H, p.I, p.E);
  MOELORA_CHECK_MSG(!p.act_fp8 && !p.xq_lo && !p.wgmma, "generic MoE GEMM: bf16 activations only");
  MOELORA_CHECK(p.align_tile_rows == moe_gemm_tile_rows(p.tile));
  MOELORA_CHECK_MSG(p.wtype != MoeWeightType::kNvfp4, "the generic MoE GEMMs take FP8 or bf16 experts (NVFP4 ones "
                    "of shapes the 4-bit layout does not take are uploaded as bf16)");
  MOELORA_CHECK(p.wtype == MoeWeightType::kBf16 || p.w_scale);
  MOELORA_CHECK(gate_up ? (p.act && p.top_k >= 1) : (p.y != nullptr));
}

// One warp per (tile, output): I features for gate_up, H rows for down.
void launch(const MoeGemmParams& p, bool gate_up, void (*fp8_kernel)(MoeGemmParams),
            void (*bf16_kernel)(MoeGemmParams), cudaStream_t stream) {
  check_generic(p, gate_up);
  const int outputs = gate_up ? p.I : p.H;
  MOELORA_CHECK_MSG(ceil_div(outputs, kWarps) <= 65535, "generic MoE GEMM: {} outputs exceed the grid", outputs);
  if (p.max_tiles <= 0) return;
  const dim3 grid(p.max_tiles, ceil_div(outputs, kWarps));
  moe_launch(p.wtype == MoeWeightType::kFp8 ? fp8_kernel : bf16_kernel, grid, dim3(kWarps * 32), 0, stream, p.pdl, p);
}

}  // namespace

void moe_gate_up_generic(const MoeGemmParams& p, cudaStream_t stream) {
  launch(p, true, moe_gate_up_generic_kernel<true>, moe_gate_up_generic_kernel<false>, stream);
}

void moe_down_generic(const MoeGemmParams& p, cudaStream_t stream) {
  launch(p, false, moe_down_generic_kernel<true>, moe_down_generic_kernel<false>, stream);
}

}  // namespace moelora::cuda
