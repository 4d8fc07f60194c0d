// Dense LoRA inside the small-M projection GEMM (dense_gemm.cu) instead of its own launch after it
// (lora_dense.cu): a CUDA-core shrink u = A x per token and part runs first, and the GEMM's final
// reduction adds u . B[n] to each output before its one bf16 rounding. Per token its own adapter
// (token_slot, -1 = none), per part (q, k, v of a fused projection: column ranges) its own factors
// and ranks (0..128), exactly the math of Backend::linear_parts with LoRA (ops/backend.h):
//   y[t, n] = x[t] . W[n] + sum_j u_q[t, j] B_{q, s(t)}[n - begin_q, j],  u_q[t, j] = x[t] . A_{q, s(t)}[j]
// for the part q whose columns hold n. f32 throughout (u is not rounded), one bf16 rounding of y.
// Written for decode (a few tokens: the shrink costs T x r x K MACs per part on the CUDA cores).
// The backend's default up to 8 tokens (CudaBackendOptions::dense_lora_in_gemm; `--no-dense-lora-in-gemm`
// turns it off): on the H100 (2026-12-05, dev/lora_dense.cu `ingemm`) it took 0.59-0.85x the time of
// the GEMM plus the segmented kernel, except o_proj at 8 tokens x 8 adapters (1.03x).
//
// Layouts as the LoRA tables keep them (LoraModuleTable): A_s [r, in] and B_s [out, r] bf16,
// element pointers per slot; A rows 16-byte aligned with in % 8 == 0 (as lora_dense).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

constexpr int kDenseLoraMaxParts = 4;
constexpr int kDenseLoraMaxRank = 128;

struct DenseLoraPart {
  int begin = 0, out = 0;           // output columns [begin, begin + out)
  const int64_t* a_ptrs = nullptr;  // device [num_slots]: A_s [r, in] element pointers (0: none)
  const int64_t* b_ptrs = nullptr;  // device [num_slots]: B_s [out, r]
  const int32_t* ranks = nullptr;   // device [num_slots]
};

struct DenseLoraEpilogue {
  const float* u = nullptr;  // [num_parts][M][ldu] written by launch_dense_lora_shrink; null: no LoRA
  int ldu = 0;               // >= the largest rank (<= kDenseLoraMaxRank)
  int M = 0;
  int num_parts = 0;
  DenseLoraPart parts[kDenseLoraMaxParts];
  const int32_t* token_slot = nullptr;  // device [M]
  int num_slots = 0;
  // The GEMM was launched directly behind the shrink that writes u: its main loop runs beside the
  // shrink and it waits only before the epilogue (launch.cuh, waiting before the epilogue). The
  // small-M kernel takes it; the naive one waits first anyway.
  bool wait_before_epilogue = false;
};

struct DenseLoraShrinkParams {
  const __nv_bfloat16* x = nullptr;  // [M, in], row stride ld_x (16-byte aligned rows)
  int64_t ld_x = 0;
  int in = 0;                        // multiple of 8
  DenseLoraEpilogue lora;            // u is written (as float*): every (part, token, j < rank) entry
  int max_rank = 0;                  // over parts and slots, <= ldu
  bool pdl = false;
};
// u[q][t][j] for every token with an adapter and j below its rank in part q (other entries are
// never read by the epilogue and stay as they were). False where nothing was launched (no tokens
// or rank 0): a GEMM behind it must then wait first (DenseLoraEpilogue::wait_before_epilogue).
bool launch_dense_lora_shrink(const DenseLoraShrinkParams& p, cudaStream_t stream);

#ifdef __CUDACC__
// The LoRA delta of output (tok, n): u . B row, f32, j ascending; 0 without an adapter, outside
// every part, or with rank 0.
__device__ __forceinline__ float dense_lora_delta(const DenseLoraEpilogue& l, int tok, int n) {
  const int s = l.token_slot[tok];
  if (s < 0 || s >= l.num_slots) return 0.0f;
  for (int q = 0; q < l.num_parts; ++q) {
    const DenseLoraPart& pt = l.parts[q];
    if (n < pt.begin || n >= pt.begin + pt.out) continue;
    const int r = min(pt.ranks[s], kDenseLoraMaxRank);
    if (r <= 0 || pt.b_ptrs[s] == 0) return 0.0f;
    const __nv_bfloat16* B = reinterpret_cast<const __nv_bfloat16*>(pt.b_ptrs[s]) + static_cast<int64_t>(n - pt.begin) * r;
    const float* u = l.u + (static_cast<int64_t>(q) * l.M + tok) * l.ldu;
    float acc = 0.0f;
    for (int j = 0; j < r; ++j) acc = fmaf(u[j], __bfloat162float(B[j]), acc);
    return acc;
  }
  return 0.0f;
}
#endif

}  // namespace moelora::cuda
