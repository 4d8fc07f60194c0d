// Router top-k on the GPU: the two selection rules of Backend::topk_softmax and
// Backend::topk_sigmoid_grouped (cpu::topk_softmax / cpu::topk_sigmoid_grouped are the spec).
// One warp per token; selection ties go to the lower expert index, as in the reference.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

enum class RouterMode : int32_t { kSoftmax = 0, kSigmoidGrouped = 1 };

struct RouterParams {
  const float* logits = nullptr;  // [T, E] f32
  const float* bias = nullptr;    // [E] f32, sigmoid-grouped only (selection only, never weights)
  int T = 0;
  int E = 0;                      // <= 1024
  int k = 0;                      // 1 <= k <= E
  RouterMode mode = RouterMode::kSoftmax;
  bool renormalize = false;
  int n_group = 1;                // sigmoid-grouped: E % n_group == 0, n_group <= 32
  int topk_group = 1;
  float scaling = 1.0f;           // sigmoid-grouped: routed_scaling_factor
  int32_t* ids = nullptr;         // [T, k] out
  float* weights = nullptr;       // [T, k] out
  bool pdl = false;               // launched with programmatic dependent launch
};

// Selection is exact w.r.t. the reference: softmax top-k compares the f32 logits (softmax is
// monotonic); sigmoid-grouped computes scores, group sums and choices in f64 like the reference.
void router_topk(const RouterParams& p, cudaStream_t stream);

}  // namespace moelora::cuda
