// Kernel launches with programmatic dependent launch (PDL), shared by every kernel family.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backends/cuda/cuda_check.h"

namespace moelora::cuda {

// ---- Programmatic dependent launch (PDL). A kernel launched with the attribute may start while its
// stream predecessor still runs: griddepcontrol.wait blocks until the predecessor has completed and
// its writes are visible, griddepcontrol.launch_dependents lets the next kernel's blocks launch and
// sit in their own wait. Without the attribute both are no-ops. Every kernel launched this way calls
// pdl_wait() before any global write and before reading anything its predecessor may write, and
// before any early return (a grid whose blocks all exited without waiting would count as complete
// while its predecessor still runs), then pdl_trigger(): so each kernel's start-up overlaps its
// predecessor's tail and everything two launches back is complete when a kernel passes its wait.
// What it saves: the launch and block-scheduling gap between dependent kernels, several per layer
// at decode sizes (bench/RESULTS.md: -11 % on the 1-token decode step).
// Waiting before the epilogue (MoeGemmParams::wait_before_epilogue, DenseLoraEpilogue::
// wait_before_epilogue): a GEMM launched right behind a LoRA shrink that follows this rule may run
// its main loop before its own wait, since the shrink triggers only after waiting, so the GEMM's
// start implies everything before the shrink is complete (its input x); it waits before its
// epilogue, the first read of the shrink's output and its first global write. Only where the
// shrink really launched: with no kernel between, the GEMM would run beside x's producer.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  MOELORA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... KernelArgs, typename... Args>
inline void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  launch_kernel(kernel, grid, block, smem, stream, true, std::forward<Args>(args)...);
}

}  // namespace moelora::cuda
