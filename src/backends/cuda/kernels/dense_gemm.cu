// Small-M dense projection on the tensor cores (see dense_gemm.cuh), its naive reference kernel and
// the dispatcher. cuBLASLt lives in dense_gemm_lt.cu.
//
// Small-M kernel layout ("swap AB"): the weight plays the MMA's A operand (16 output rows per warp
// tile) and the tokens its B operand (8 per n-tile), so a decode batch of 1..8 tokens costs one MMA
// column and the weight is read exactly once. Each lane owns a contiguous 32-element run of every
// 128-wide K block: for a 16-row tile the warp reads 16 rows x 128 contiguous bytes (FP8) per K block
// — whole cache lines — and no shuffles are needed because the MMA contraction order over k is free
// as long as A and B agree (lane t supplies physical k = 32t + 4s + {0,1} as logical k = 2t, 2t+1 of
// step s, and 32t + 4s + {2,3} as logical k = 2t+8, 2t+9).
// FP8: the 8 MMA steps of one K block accumulate unscaled products in f32; the block's scale then
// multiplies that partial sum once (exactly the dequantised math, one rounding per block).
// Warps of a block split K (k_warps) and meet in shared memory, in a fixed order (deterministic).
#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_utils.cuh"
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "backends/cuda/kernels/fp8_quant.cuh"
#include "backends/cuda/kernels/nvfp4_device.cuh"
#include "backends/cuda_plan/dense_choices.h"
#include "ops/weight_format.h"

namespace moelora::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kKBlock = 128;

struct SmallMParams {
  const bf16* x;
  int64_t ld_x;
  int M;
  const void* w;
  int N, K;
  const float* scale_inv;
  int scale_cols, block_out, split_rows;
  const uint8_t* group_scale;  // NVFP4 [N, K / 16]
  const float* global_scale;   // NVFP4 [N]
  bf16* y;
  float* y_f32;
  int64_t ld_y;
  DenseLoraEpilogue lora;
};

// The raw weight bytes of one lane for one 16-row tile and K block (rows r0 and r1, 32 elements
// each): FP8 2 x 32 bytes, bf16 2 x 64 bytes, NVFP4 2 x 16 bytes (two packed groups) plus the two
// groups' scale bytes of each row. Kept raw so that the next block can be in flight while this one
// is converted and multiplied.
template <WeightType WT>
struct RunScales {};
template <>
struct RunScales<WeightType::kNvfp4> {
  uint32_t s0, s1;  // rows r0, r1: the scale bytes of the run's two groups (low byte first)
};
template <WeightType WT>
struct WeightRun : RunScales<WT> {
  uint4 v[WT == WeightType::kFP8E4M3 ? 4 : WT == WeightType::kNvfp4 ? 2 : 8];
};

template <WeightType WT>
__device__ __forceinline__ void load_weight_run(const SmallMParams& p, int r0, int r1, bool v0, bool v1, int kc,
                                                bool kv, WeightRun<WT>& w) {
  if constexpr (WT == WeightType::kNvfp4) {
    const uint8_t* base = static_cast<const uint8_t*>(p.w);
    const int64_t row_bytes = p.K / 2, srow = p.K / cuda_plan::kNvfp4Group;
    w.v[0] = ld_stream_u4_pred(base + static_cast<int64_t>(v0 ? r0 : 0) * row_bytes + (kv ? kc / 2 : 0), v0 && kv);
    w.v[1] = ld_stream_u4_pred(base + static_cast<int64_t>(v1 ? r1 : 0) * row_bytes + (kv ? kc / 2 : 0), v1 && kv);
    const int g = kv ? kc / cuda_plan::kNvfp4Group : 0;  // even: K % 32 == 0, runs start at 32-value boundaries
    w.s0 = v0 && kv ? __ldg(reinterpret_cast<const unsigned short*>(p.group_scale + r0 * srow + g)) : 0u;
    w.s1 = v1 && kv ? __ldg(reinterpret_cast<const unsigned short*>(p.group_scale + r1 * srow + g)) : 0u;
  } else if constexpr (WT == WeightType::kFP8E4M3) {
    const uint8_t* base = static_cast<const uint8_t*>(p.w);
    const uint8_t* w0 = base + static_cast<int64_t>(v0 ? r0 : 0) * p.K + (kv ? kc : 0);
    const uint8_t* w1 = base + static_cast<int64_t>(v1 ? r1 : 0) * p.K + (kv ? kc : 0);
    w.v[0] = ld_stream_u4_pred(w0, v0 && kv);
    w.v[1] = ld_stream_u4_pred(w0 + 16, v0 && kv);
    w.v[2] = ld_stream_u4_pred(w1, v1 && kv);
    w.v[3] = ld_stream_u4_pred(w1 + 16, v1 && kv);
  } else {
    const bf16* base = static_cast<const bf16*>(p.w);
    const bf16* w0 = base + static_cast<int64_t>(v0 ? r0 : 0) * p.K + (kv ? kc : 0);
    const bf16* w1 = base + static_cast<int64_t>(v1 ? r1 : 0) * p.K + (kv ? kc : 0);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w.v[q] = ld_stream_u4_pred(w0 + 8 * q, v0 && kv);
      w.v[4 + q] = ld_stream_u4_pred(w1 + 8 * q, v1 && kv);
    }
  }
}

// A fragments of the 8 MMA steps of one K block (see the layout note at the top).
template <WeightType WT>
__device__ __forceinline__ void weight_frags(const WeightRun<WT>& w, uint32_t (&a)[8][4]) {
  if constexpr (WT == WeightType::kNvfp4) {
    // Steps 0-3 are the run's first 16-value group, 4-7 its second; each group's registers carry
    // its scale (nvfp4_group_regs: register 2s' + h = a0 / a2 of step s' of the group).
    const uint32_t sc0 = nvfp4_scales_bf16x2(w.s0 & 0xff, (w.s0 >> 8) & 0xff);  // row r0: groups 0, 1
    const uint32_t sc1 = nvfp4_scales_bf16x2(w.s1 & 0xff, (w.s1 >> 8) & 0xff);  // row r1
    uint32_t g0[8], g1[8];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t w00 = half ? w.v[0].z : w.v[0].x, w01 = half ? w.v[0].w : w.v[0].y;
      const uint32_t w10 = half ? w.v[1].z : w.v[1].x, w11 = half ? w.v[1].w : w.v[1].y;
      nvfp4_group_regs(w00, w01, half ? bf16x2_dup_hi(sc0) : bf16x2_dup_lo(sc0), g0);
      nvfp4_group_regs(w10, w11, half ? bf16x2_dup_hi(sc1) : bf16x2_dup_lo(sc1), g1);
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        a[4 * half + st][0] = g0[2 * st];
        a[4 * half + st][2] = g0[2 * st + 1];
        a[4 * half + st][1] = g1[2 * st];
        a[4 * half + st][3] = g1[2 * st + 1];
      }
    }
  } else if constexpr (WT == WeightType::kFP8E4M3) {
    const uint32_t row0[8] = {w.v[0].x, w.v[0].y, w.v[0].z, w.v[0].w, w.v[1].x, w.v[1].y, w.v[1].z, w.v[1].w};
    const uint32_t row1[8] = {w.v[2].x, w.v[2].y, w.v[2].z, w.v[2].w, w.v[3].x, w.v[3].y, w.v[3].z, w.v[3].w};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      fp8x4_to_bf16x2x2(row0[s], a[s][0], a[s][2]);
      fp8x4_to_bf16x2x2(row1[s], a[s][1], a[s][3]);
    }
  } else {
    uint32_t row0[16], row1[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      row0[4 * q] = w.v[q].x, row0[4 * q + 1] = w.v[q].y, row0[4 * q + 2] = w.v[q].z, row0[4 * q + 3] = w.v[q].w;
      row1[4 * q] = w.v[4 + q].x, row1[4 * q + 1] = w.v[4 + q].y, row1[4 * q + 2] = w.v[4 + q].z,
                row1[4 * q + 3] = w.v[4 + q].w;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      a[s][0] = row0[2 * s];
      a[s][2] = row0[2 * s + 1];
      a[s][1] = row1[2 * s];
      a[s][3] = row1[2 * s + 1];
    }
  }
}

template <WeightType WT, int MT, int RG>
__global__ void __launch_bounds__(kBlockThreads) dense_small_m_kernel(SmallMParams p) {
  constexpr bool kFp8 = WT == WeightType::kFP8E4M3;
  extern __shared__ float red[];  // [k_warps][RG][16][MT * 8]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int k_warps = blockDim.x / 32 / RG;
  const int rg = warp % RG, kw = warp / RG;
  const int row_base = blockIdx.x * (16 * RG);
  const int r0 = row_base + rg * 16 + g, r1 = r0 + 8;
  const bool v0 = r0 < p.N, v1 = r1 < p.N;
  const int m_base = blockIdx.y * (8 * MT);
  const int kblocks = ceil_div(p.K, kKBlock);

  const float* srow0 = nullptr;
  const float* srow1 = nullptr;
  if constexpr (kFp8) {
    srow0 = p.scale_inv + static_cast<int64_t>(fp8_scale_row_block(v0 ? r0 : 0, p.block_out, p.split_rows)) * p.scale_cols;
    srow1 = p.scale_inv + static_cast<int64_t>(fp8_scale_row_block(v1 ? r1 : 0, p.block_out, p.split_rows)) * p.scale_cols;
  }

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

  // One K block ahead in flight: the weight run of block kb + k_warps is requested before block kb
  // is multiplied, so a warp never waits for two DRAM round trips in a row.
  auto run_of = [&](int kb) { return kb * kKBlock + t * 32; };
  WeightRun<WT> cur, nxt;
  if (kw < kblocks) load_weight_run<WT>(p, r0, r1, v0, v1, run_of(kw), run_of(kw) < p.K, cur);
  // The weights and scales are constants of the model, so the first run is requested before the
  // wait for the previous kernel (see launch_pdl in launch.cuh): its DRAM round trip overlaps
  // that kernel's tail. Everything that kernel may write (x, y) is touched only after the wait,
  // which every block reaches (no early exit above). Behind a LoRA shrink (lora.wait_before_epilogue)
  // the wait moves to the epilogue: x is complete already, only u and y are the shrink's business.
  if (!p.lora.wait_before_epilogue) pdl_wait();
  pdl_trigger();
  for (int kb = kw; kb < kblocks; kb += k_warps) {
    const int kc = run_of(kb);
    const bool kv = kc < p.K;  // K % 32 == 0: a lane's run is all in or all out
    const int kn = kb + k_warps;
    if (kn < kblocks) load_weight_run<WT>(p, r0, r1, v0, v1, run_of(kn), run_of(kn) < p.K, nxt);
    uint32_t a[8][4];
    weight_frags<WT>(cur, a);
    float part[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      part[mt][0] = part[mt][1] = part[mt][2] = part[mt][3] = 0.0f;
      if (m_base + mt * 8 >= p.M) continue;
      const int tok = m_base + mt * 8 + g;
      const bool tv = tok < p.M && kv;
      const bf16* xr = p.x + static_cast<int64_t>(tv ? tok : 0) * p.ld_x + (kv ? kc : 0);
      uint32_t xw[16];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint4 u = ldg_u4_pred(xr + 8 * q, tv);
        xw[4 * q] = u.x, xw[4 * q + 1] = u.y, xw[4 * q + 2] = u.z, xw[4 * q + 3] = u.w;
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        if constexpr (kFp8)
          mma_bf16_16816(part[mt], a[s], xw[2 * s], xw[2 * s + 1]);
        else
          mma_bf16_16816(acc[mt], a[s], xw[2 * s], xw[2 * s + 1]);
      }
    }
    if constexpr (kFp8) {
      // The scale belongs to the output row (r0 / r1) and the K block, never to this lane's run:
      // the accumulator columns of a lane are tokens, unrelated to which K run it loaded.
      const float s0 = v0 ? srow0[kb] : 0.0f;
      const float s1 = v1 ? srow1[kb] : 0.0f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc[mt][0] = fmaf(part[mt][0], s0, acc[mt][0]);
        acc[mt][1] = fmaf(part[mt][1], s0, acc[mt][1]);
        acc[mt][2] = fmaf(part[mt][2], s1, acc[mt][2]);
        acc[mt][3] = fmaf(part[mt][3], s1, acc[mt][3]);
      }
    }
    cur = nxt;
  }

  if constexpr (WT == WeightType::kNvfp4) {  // weight_scale_2 * 2^26 of rows r0 (acc 0, 1) and r1 (2, 3)
    const float gs0 = v0 ? __ldg(p.global_scale + r0) : 0.0f, gs1 = v1 ? __ldg(p.global_scale + r1) : 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[mt][0] *= gs0;
      acc[mt][1] *= gs0;
      acc[mt][2] *= gs1;
      acc[mt][3] *= gs1;
    }
  }
  // Partial tiles of every K warp into shared memory, then a fixed-order sum per output.
  constexpr int kCols = MT * 8;
  float* mine = red + ((kw * RG + rg) * 16) * kCols;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mine[g * kCols + mt * 8 + 2 * t] = acc[mt][0];
    mine[g * kCols + mt * 8 + 2 * t + 1] = acc[mt][1];
    mine[(g + 8) * kCols + mt * 8 + 2 * t] = acc[mt][2];
    mine[(g + 8) * kCols + mt * 8 + 2 * t + 1] = acc[mt][3];
  }
  __syncthreads();
  if (p.lora.wait_before_epilogue) pdl_wait();  // the shrink's u, and before the first write
  const int rows = 16 * RG;
  for (int idx = threadIdx.x; idx < rows * kCols; idx += blockDim.x) {
    const int rl = idx % rows, col = idx / rows;  // rows fastest: coalesced stores of y
    const int tok = m_base + col, n = row_base + rl;
    if (tok >= p.M || n >= p.N) continue;
    float s = 0.0f;
    for (int k = 0; k < k_warps; ++k) s += red[((k * RG + rl / 16) * 16 + rl % 16) * kCols + col];
    if (p.lora.u) s += dense_lora_delta(p.lora, tok, n);
    if (p.y_f32)
      p.y_f32[static_cast<int64_t>(tok) * p.ld_y + n] = s;
    else
      p.y[static_cast<int64_t>(tok) * p.ld_y + n] = __float2bfloat16(s);
  }
}

// Naive reference: one warp per (token, output row), dequantising as it goes.
__global__ void dense_naive_kernel(SmallMParams p, WeightType type) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (wid >= static_cast<int64_t>(p.M) * p.N) return;
  const int tok = static_cast<int>(wid / p.N), n = static_cast<int>(wid % p.N);
  const int lane = threadIdx.x & 31;
  const bf16* x = p.x + static_cast<int64_t>(tok) * p.ld_x;
  float acc = 0.0f;
  if (type == WeightType::kNvfp4) {
    // Element k: group k / 16, word (k % 16) / 8, register (k % 8) / 2, half k % 2 of the packed row.
    const uint8_t* w = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(n) * (p.K / 2);
    const uint8_t* gs = p.group_scale + static_cast<int64_t>(n) * (p.K / cuda_plan::kNvfp4Group);
    for (int k = lane; k < p.K; k += 32) {
      const uint32_t word = __ldg(reinterpret_cast<const unsigned*>(w + (k / 16) * 8 + ((k % 16) / 8) * 4));
      const uint32_t pair = nvfp4_bf16x2_mul(nvfp4_pair(word, (k % 8) / 2), nvfp4_scales_bf16x2(gs[k / 16], gs[k / 16]));
      acc = fmaf(__bfloat162float(x[k]), __uint_as_float(k % 2 ? pair & 0xffff0000u : pair << 16), acc);
    }
    acc *= p.global_scale[n];
  } else if (type == WeightType::kFP8E4M3) {
    const uint8_t* w = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(n) * p.K;
    const float* srow = p.scale_inv + static_cast<int64_t>(fp8_scale_row_block(n, p.block_out, p.split_rows)) * p.scale_cols;
    for (int k = lane; k < p.K; k += 32) {
      const float wv = __half2float(__half(__nv_cvt_fp8_to_halfraw(w[k], __NV_E4M3))) * srow[k / kKBlock];
      acc = fmaf(__bfloat162float(x[k]), wv, acc);
    }
  } else {
    const bf16* w = static_cast<const bf16*>(p.w) + static_cast<int64_t>(n) * p.K;
    for (int k = lane; k < p.K; k += 32) acc = fmaf(__bfloat162float(x[k]), __bfloat162float(w[k]), acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    if (p.lora.u) acc += dense_lora_delta(p.lora, tok, n);
    if (p.y_f32)
      p.y_f32[static_cast<int64_t>(tok) * p.ld_y + n] = acc;
    else
      p.y[static_cast<int64_t>(tok) * p.ld_y + n] = __float2bfloat16(acc);
  }
}

SmallMParams to_params(const DenseArgs& a) {
  MOELORA_CHECK_MSG((a.y == nullptr) != (a.y_f32 == nullptr), "dense: exactly one of y / y_f32");
  const bool fp8 = a.w.type == WeightType::kFP8E4M3;
  MOELORA_CHECK_MSG(!fp8 || (a.w.scale_inv != nullptr && a.w.block_in == kKBlock && a.w.block_out > 0),
                    "dense: FP8 weights need scale_inv with 128-wide column blocks");
  MOELORA_CHECK_MSG(a.w.type != WeightType::kNvfp4 ||
                        (a.w.group_scale && a.w.global_scale && a.w.in % cuda_plan::kNvfp4Group == 0 &&
                         (reinterpret_cast<uintptr_t>(a.w.w) & 3) == 0 &&
                         (reinterpret_cast<uintptr_t>(a.w.group_scale) & 1) == 0),
                    "dense: NVFP4 weights need group and global scales and whole 16-value groups");
  MOELORA_CHECK_MSG(!a.lora.u || (a.lora.M == a.M && a.lora.token_slot && a.lora.num_parts >= 1 &&
                                    a.lora.num_parts <= kDenseLoraMaxParts),
                    "dense: a LoRA epilogue for {} tokens of {} parts on a {}-token GEMM", a.lora.M, a.lora.num_parts, a.M);
  return SmallMParams{a.x,           a.ld_x,     a.M,  a.w.w, a.w.out, a.w.in, a.w.scale_inv, ceil_div(a.w.in, kKBlock),
                      a.w.block_out, a.w.split_rows, a.w.group_scale, a.w.global_scale, a.y, a.y_f32, a.ld_y, a.lora};
}

bool small_m_supported(const DenseArgs& a) {
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return a.w.in % cuda_plan::kDenseSmallMInMultiple == 0 && a.ld_x % 8 == 0 && aligned16(a.x) && aligned16(a.w.w);
}

template <WeightType WT, int MT>
void launch_mt(const SmallMParams& p, int rg, int kw, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.N, 16 * rg), ceil_div(p.M, 8 * MT));
  const size_t smem = static_cast<size_t>(rg * kw) * 16 * MT * 8 * sizeof(float);
  const int threads = 32 * rg * kw;
  switch (rg) {
    case 1: launch_pdl(dense_small_m_kernel<WT, MT, 1>, dim3(grid), dim3(threads), smem, stream, p); break;
    case 2: launch_pdl(dense_small_m_kernel<WT, MT, 2>, dim3(grid), dim3(threads), smem, stream, p); break;
    case 4: launch_pdl(dense_small_m_kernel<WT, MT, 4>, dim3(grid), dim3(threads), smem, stream, p); break;
    default: MOELORA_CHECK_MSG(false, "dense: row_groups must be 1, 2 or 4");
  }
}

template <WeightType WT>
void launch_fp(const SmallMParams& p, int mt, int rg, int kw, cudaStream_t stream) {
  switch (mt) {
    case 1: launch_mt<WT, 1>(p, rg, kw, stream); break;
    case 2: launch_mt<WT, 2>(p, rg, kw, stream); break;
    case 4: launch_mt<WT, 4>(p, rg, kw, stream); break;
    default: launch_mt<WT, 8>(p, rg, kw, stream); break;
  }
}

}  // namespace

void launch_dense_naive(const DenseArgs& a, cudaStream_t stream) {
  const SmallMParams p = to_params(a);
  if (a.M == 0 || a.w.out == 0) return;
  const int64_t warps = static_cast<int64_t>(a.M) * a.w.out;
  launch_pdl(dense_naive_kernel, dim3(static_cast<unsigned>(ceil_div64(warps, 8))), dim3(256), 0, stream, p, a.w.type);
  MOELORA_CUDA_CHECK_LAUNCH();
}

void launch_dense_small_m(const DenseArgs& a, cudaStream_t stream, DenseSmallMConfig cfg) {
  const SmallMParams p = to_params(a);
  if (a.M == 0 || a.w.out == 0) return;
  if (!small_m_supported(a)) return launch_dense_naive(a, stream);
  const cuda_plan::DenseSmallMTiling t =
      cuda_plan::choose_dense_small_m_tiling(a.M, a.w.in, cfg.row_groups, cfg.k_warps);
  const int mt = t.m_tiles, rg = t.row_groups, kw = t.k_warps;
  MOELORA_CHECK(rg * kw <= 8);
  switch (a.w.type) {
    case WeightType::kFP8E4M3: launch_fp<WeightType::kFP8E4M3>(p, mt, rg, kw, stream); break;
    case WeightType::kNvfp4: launch_fp<WeightType::kNvfp4>(p, mt, rg, kw, stream); break;
    case WeightType::kBF16: launch_fp<WeightType::kBF16>(p, mt, rg, kw, stream); break;
  }
  MOELORA_CUDA_CHECK_LAUNCH();
}

namespace {
// One thread per 16-value group: its 8 packed bytes, its scale and its row's global scale -> 16 bf16.
__global__ void nvfp4_dequant_kernel(const __grid_constant__ DenseWeight w, bf16* out) {
  pdl_wait();  // first: see launch_pdl (launch.cuh)
  pdl_trigger();
  const int groups_per_row = w.in / cuda_plan::kNvfp4Group;
  const int64_t groups = static_cast<int64_t>(w.out) * groups_per_row;
  const uint8_t* codes = static_cast<const uint8_t*>(w.w);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = g / groups_per_row;
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(codes + g * 8));
    const uint32_t sc = nvfp4_scales_bf16x2(w.group_scale[g], w.group_scale[g]);
    const float gs = w.global_scale[row];
    uint32_t r[8];
    nvfp4_group_regs(q.x, q.y, sc, r);  // register i: values 2i, 2i + 1 of the group, times 2^-26
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(__uint_as_float(r[i] << 16) * gs, __uint_as_float(r[i] & 0xffff0000u) * gs);
      o[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + g * cuda_plan::kNvfp4Group);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

}  // namespace

void launch_nvfp4_dequant(const DenseWeight& w, bf16* out, cudaStream_t stream) {
  MOELORA_CHECK(w.type == WeightType::kNvfp4 && w.in % cuda_plan::kNvfp4Group == 0 && w.group_scale &&
                w.global_scale && (reinterpret_cast<uintptr_t>(out) & 15) == 0 && (reinterpret_cast<uintptr_t>(w.w) & 7) == 0);
  const int64_t groups = static_cast<int64_t>(w.out) * (w.in / cuda_plan::kNvfp4Group);
  if (groups == 0) return;
  const int grid = static_cast<int>(std::min<int64_t>(ceil_div64(groups, 256), 8192));
  launch_pdl(nvfp4_dequant_kernel, dim3(grid), dim3(256), 0, stream, w, out);
  MOELORA_CUDA_CHECK_LAUNCH();
}

size_t dense_nvfp4_scratch_bytes(int out, int in) {
  return static_cast<size_t>(cuda_plan::nvfp4_dequant_chunk_rows(out, in)) * in * sizeof(bf16) + 256;
}

size_t dense_fp8_scratch_bytes(int max_M, int in) {
  const size_t q = (static_cast<size_t>(max_M) * ((in + 15) / 16 * 16) + 255) / 256 * 256;
  const size_t s = static_cast<size_t>(ceil_div(in, kFp8Group)) * max_M * sizeof(float);
  return q + s + 256;
}

namespace {
// Layouts cuBLASLt's block-scaled FP8 GEMM was seen to get right on the H200: the weight's scale
// rows must have a multiple of 4 column blocks (otherwise it reads them with a padded stride),
// and a split weight must restart on 16-byte aligned rows of the output.
bool lt_fp8_shape_ok(const DenseWeight& w) {
  return w.block_out == 128 && w.block_in == 128 && w.in % 128 == 0 && (w.in / 128) % 4 == 0 &&
         (w.split_rows <= 0 || w.split_rows % 8 == 0);
}

cuda_plan::DenseWeights plan_weights(WeightType t) {
  switch (t) {
    case WeightType::kFP8E4M3: return cuda_plan::DenseWeights::kFp8;
    case WeightType::kNvfp4: return cuda_plan::DenseWeights::kNvfp4;
    case WeightType::kBF16: break;
  }
  return cuda_plan::DenseWeights::kBf16;
}
}  // namespace

cuda_plan::DensePath dense_path(int M, WeightType t) { return cuda_plan::choose_dense_path(M, plan_weights(t)); }

void dense_linear(DenseGemmContext& ctx, const DenseArgs& a, DenseScratch scratch, cudaStream_t stream) {
  if (a.M == 0 || a.w.out == 0) return;
  const bool fp8 = a.w.type == WeightType::kFP8E4M3;
  // A LoRA epilogue runs in our kernels only.
  if (a.lora.u || dense_path(a.M, a.w.type) == cuda_plan::DensePath::kSmallM)
    return launch_dense_small_m(a, stream);
  if (a.w.type == WeightType::kNvfp4) {
    // Row chunks of the weight as bf16 in scratch, each multiplied by cuBLASLt's bf16 GEMM into its
    // output columns; our kernel where scratch is missing or cuBLASLt declines.
    // (A smaller scratch than dense_nvfp4_scratch_bytes takes more passes of fewer rows.)
    const int64_t fit = scratch.bytes > 256 ? static_cast<int64_t>((scratch.bytes - 256) / (2 * a.w.in)) / 8 * 8 : 0;
    const int chunk = static_cast<int>(std::min<int64_t>(cuda_plan::nvfp4_dequant_chunk_rows(a.w.out, a.w.in), fit));
    if (chunk < std::min(a.w.out, 8)) return launch_dense_small_m(a, stream);
    auto* wb = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(scratch.ptr) + 255) / 256 * 256);
    for (int r0 = 0; r0 < a.w.out; r0 += chunk) {
      DenseArgs part = a;
      part.w.out = std::min(chunk, a.w.out - r0);
      part.w.w = static_cast<const uint8_t*>(a.w.w) + static_cast<int64_t>(r0) * (a.w.in / 2);
      part.w.group_scale = a.w.group_scale + static_cast<int64_t>(r0) * (a.w.in / cuda_plan::kNvfp4Group);
      part.w.global_scale = a.w.global_scale + r0;
      if (a.y) part.y = a.y + r0;
      if (a.y_f32) part.y_f32 = a.y_f32 + r0;
      launch_nvfp4_dequant(part.w, wb, stream);
      DenseArgs b = part;
      b.w = DenseWeight{};
      b.w.w = wb;
      b.w.type = WeightType::kBF16;
      b.w.out = part.w.out;
      b.w.in = a.w.in;
      if (!ctx.gemm_bf16(b, stream)) launch_dense_small_m(part, stream);
    }
    return;
  }
  if (!fp8) {
    if (!ctx.gemm_bf16(a, stream)) launch_dense_small_m(a, stream);
    return;
  }
  // cuBLASLt takes the tokens in multiples of 4: with other counts it misplaces the VEC128
  // activation scales (seen on the H200: M = 65 off by 3 %, M = 64 / 100 exact). The last M % 4
  // tokens go through our kernel.
  const int m4 = a.M / 4 * 4;
  const int64_t ld_q = (a.w.in + 15) / 16 * 16;
  bool done = false;
  if (lt_fp8_shape_ok(a.w) && scratch.bytes >= dense_fp8_scratch_bytes(m4, a.w.in)) {
    auto base = (reinterpret_cast<uintptr_t>(scratch.ptr) + 255) / 256 * 256;
    auto* xq = reinterpret_cast<uint8_t*>(base);
    auto* xs = reinterpret_cast<float*>(base + (static_cast<size_t>(m4) * ld_q + 255) / 256 * 256);
    Fp8QuantParams q;
    q.x = a.x;
    q.ld_x = a.ld_x;
    q.M = m4;
    q.K = a.w.in;
    q.q = xq;
    q.ld_q = ld_q;
    q.scales = xs;
    q.scale_ld = m4;
    q.layout = Fp8ScaleLayout::kGroupMajor;
    launch_fp8_quant_per_token(q, stream);
    DenseArgs head = a;
    head.M = m4;
    done = ctx.gemm_fp8(head, xq, ld_q, xs, stream);
  }
  if (!done) return launch_dense_small_m(a, stream);  // cuBLASLt declined: our kernel does all M
  if (m4 < a.M) {
    DenseArgs tail = a;
    tail.M = a.M - m4;
    tail.x = a.x + static_cast<int64_t>(m4) * a.ld_x;
    if (a.y) tail.y = a.y + static_cast<int64_t>(m4) * a.ld_y;
    if (a.y_f32) tail.y_f32 = a.y_f32 + static_cast<int64_t>(m4) * a.ld_y;
    launch_dense_small_m(tail, stream);
  }
}

}  // namespace moelora::cuda
