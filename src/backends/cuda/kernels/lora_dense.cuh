// Multi-adapter LoRA on dense projections: y[t] += B_s (A_s x[t]) for s = slot[t] >= 0, with the
// adapter scale already folded into B (PEFT layout: A [rank, in], B [out, rank], bf16), reached
// through per-slot pointer tables exactly as LoraModuleTable (I64 element pointers, I32 ranks;
// rank 0 = the adapter lacks this module). Tokens of slot -1 are untouched.
//
// Two paths, chosen by lora_plan() from what the batch holds:
// - Segmented (any mix): tokens grouped by slot on the host into work items of <= 32 tokens of one
//   slot and one projection. ONE launch does shrink and expand for every item of up to
//   kLoraMaxProblems projections (q,k,v or gate,up): each item runs on a thread-block cluster
//   whose blocks split the shrink over `in`, exchange the rank-r partial sums through distributed
//   shared memory, then each expand a slice of `out` (no workspace, no atomics, deterministic).
//   Metadata lives in a device buffer written before the launch (lora_upload_plan), so the launch
//   itself is graph-safe; for capture, plan with a fixed `capacity` and launch that many items.
// - Single adapter (every token on one slot s, no base-only token, and at least
//   LoraPlanOptions::single_adapter_min_tokens tokens): two cuBLAS GEMMs per projection on slot s's
//   own A and B (found through the device tables at s, never slot 0). The slot, rank and T are
//   baked into those calls: meant for eager (prefill) steps.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace moelora::cuda {

constexpr int kLoraMaxProblems = 4;
constexpr int kLoraMaxRank = 128;
constexpr int kLoraTokensPerItem = 32;

// One projection's LoRA in a launch.
struct LoraProblem {
  const __nv_bfloat16* x = nullptr;  // [T, in], row stride ld_x (the projection's input)
  int64_t ld_x = 0;
  __nv_bfloat16* y = nullptr;  // [T, out], row stride ld_y (the base output; LoRA adds into it)
  int64_t ld_y = 0;
  int in = 0;  // multiple of 8 (16-byte pieces of x and A rows)
  int out = 0;
  int num_slots = 0;
  const int64_t* a_ptrs = nullptr;  // device [num_slots]: A_s element pointers
  const int64_t* b_ptrs = nullptr;  // device [num_slots]: B_s element pointers
  const int32_t* ranks = nullptr;   // device [num_slots]
  const int* host_rank = nullptr;   // host [num_slots] (LoraModuleTable::host_rank), for planning
};

struct LoraPlanOptions {
  bool single_adapter_gemm = true;  // allow the cuBLAS path when the batch holds one adapter only
  // ... and at least this many tokens. Measured on the H200 (bench/RESULTS.md): at decode sizes the
  // fused segmented kernel is as fast or faster (cuBLAS picks slow kernels for the rank-r shrink of
  // o_proj: 16-85 us), so the cuBLAS GEMMs serve prefill-sized batches only by default.
  int single_adapter_min_tokens = 256;
};

// Host-side plan of one step; `meta` is copied verbatim to the device.
// meta = [num_items, capacity, T, 0] ++ items[capacity] x {problem, slot, first, count}
//        ++ perm[T] (token indices grouped by slot, stable).
struct LoraPlan {
  int num_tokens = 0;
  int num_problems = 0;
  bool single_adapter = false;  // take the cuBLAS path
  int single_slot = -1;
  int cluster = 1;    // blocks per work item (thread-block cluster size)
  int capacity = 0;   // item slots in meta
  int num_items = 0;
  std::vector<int32_t> meta;
};

// Plans LoRA for tokens with host slots token_slot[T] over `num_problems` projections (which must
// share T and slots). capacity = 0 sizes the metadata exactly; a graph bucket passes
// lora_max_items(...) for its largest batch and launches with grid_items = capacity.
LoraPlan lora_plan(const int32_t* token_slot, int T, const LoraProblem* problems, int num_problems,
                   const LoraPlanOptions& opt = {}, int capacity = 0);
int lora_max_items(int max_tokens, int num_slots, int num_problems);
size_t lora_meta_bytes(int capacity, int max_tokens);
// Copies plan.meta to `dev_meta` (cudaMemcpyAsync from the plan's pageable memory: staged before
// the call returns, so the plan may die afterwards). Not for use inside a capture.
void lora_upload_plan(const LoraPlan& plan, void* dev_meta, size_t dev_bytes, cudaStream_t stream);

// cuBLAS handle and workspace for the single-adapter path (created once, outside any capture).
class LoraContext {
 public:
  LoraContext();
  ~LoraContext();
  LoraContext(const LoraContext&) = delete;
  LoraContext& operator=(const LoraContext&) = delete;
  cublasHandle_t handle() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

// Scratch of the single-adapter path: the shrink result [T, rank] per projection and the pointer
// arrays cuBLAS reads.
size_t lora_single_scratch_bytes(int max_tokens, const LoraProblem* problems, int num_problems);
struct LoraScratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Runs the plan: y += LoRA for every projection. dev_meta holds the uploaded plan (segmented path);
// grid_items = 0 launches plan.num_items items, otherwise that many (>= plan.num_items; the extra
// ones exit at once, which is how a captured graph serves any batch up to its capacity).
void lora_run(LoraContext& ctx, const LoraProblem* problems, int num_problems, const LoraPlan& plan,
              const void* dev_meta, LoraScratch scratch, cudaStream_t stream, int grid_items = 0);

// Raises the kernel's dynamic shared-memory limit (a function attribute, not a stream operation).
// Launches call it themselves; call it once at start-up so that no first launch happens inside a
// stream capture.
void lora_dense_prepare();

// The segmented kernel alone (what lora_run launches when plan.single_adapter is false).
void launch_lora_segmented(const LoraProblem* problems, int num_problems, int cluster, const void* dev_meta,
                           int grid_items, cudaStream_t stream);

}  // namespace moelora::cuda
