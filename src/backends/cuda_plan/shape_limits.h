// What the CUDA kernels cannot take, decided on the host from a model's shapes alone (no GPU
// needed: tests/cuda_plan checks it on the CPU). CudaBackend::check_model_shapes calls it before
// any weight is loaded, so such a model is refused with a message naming each limit instead of
// aborting in a kernel launcher mid-forward. The kernels keep their own MOELORA_CHECKs (they guard
// invariants); every limit here mirrors one of them, cited in shape_limits.cpp and docs/gpu.md
// ("What the CUDA backend refuses at load, and why"). A kernel that learns a new shape must
// update the mirror here, or the model stays refused.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "backends/cuda_plan/dense_choices.h"
#include "backends/cuda_plan/mla_choices.h"
#include "backends/cuda_plan/moe_choices.h"
#include "core/status.h"
#include "ops/model_shapes.h"

namespace moelora::cuda_plan {

// The kernels' constants this check depends on (the CUDA backend static_asserts the ones its
// headers expose).
inline constexpr int kRouterMaxExperts = 1024;   // router.cu: register arrays for E <= 1024
inline constexpr int kRouterMaxTopK = 32;        // router.cu: lane j of one warp holds choice j
inline constexpr int kRouterMaxGroups = 32;      // router.cu: lane g holds group g's score
inline constexpr int kFp8Block = 128;            // dense_gemm.cu kKBlock; moe_gemm.cu's scale rows
inline constexpr int kLoraInMultiple = 8;        // lora_dense.cu: the shrink reads 8-value (16-byte) pieces
inline constexpr int kMaxLoraRank = 128;         // lora_dense.cuh kLoraMaxRank, moe_lora.cuh kMoeLoraMaxRank
inline constexpr int kMoeMaxLoraBuckets = 12288;  // moe_align.cuh: (slot, expert) groups + 1
inline constexpr size_t kMoeAlignMaxSmem = 200 * 1024;  // moe_align.cu kAlignMaxSmem
inline constexpr int kSamplingVocabLimit = 1 << 24;     // sampling.cu: ids radix-selected in 3 bytes

// Largest number of adapter slots moe_align's one-CTA LoRA grouping handles with E experts
// (both its bucket count and its shared memory bound it).
int moe_lora_max_slots(int num_experts);

// One sentence per limit the shapes break ("attention: ..."), in a fixed order; empty = OK.
std::vector<std::string> shape_limit_violations(const ModelShapes& s);
// OK, or kUnsupported: "the CUDA kernels cannot run this <arch> model: <each violation>; ...".
Status check_shape_limits(const ModelShapes& s);

}  // namespace moelora::cuda_plan
