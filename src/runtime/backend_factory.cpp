#include "runtime/backend_factory.h"

#include "backends/cpu/cpu_backend.h"
#ifdef MOELORA_HAVE_CUDA
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/device_info.h"
#endif

namespace moelora {

Result<std::unique_ptr<Backend>> make_backend(const BackendOptions& opts) {
  if (opts.name == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  if (opts.name == "cpu-bf16") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(/*bf16_activations=*/true));
  if (opts.name == "cuda") {
#ifdef MOELORA_HAVE_CUDA
    if (!cuda::query_device().available) return unsupported("no CUDA device is visible to this process");
    CudaBackendOptions o;
    o.overlap = opts.cuda_overlap;
    o.graphs = opts.cuda_graphs;
    o.moe_fp8_activations = opts.cuda_moe_fp8_activations;
    o.dense_lora_in_gemm = opts.cuda_dense_lora_in_gemm;
    o.kv_write_in_head_pass = opts.cuda_kv_write_in_head_pass;
    o.shared_experts_concurrent = opts.cuda_shared_experts_concurrent;
    o.moe_lora_shrink_beside_gemm = opts.cuda_moe_lora_beside_gemm;
    o.dense_lora_shrink_beside_gemm = opts.cuda_dense_lora_beside_gemm;
    return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(o));
#else
    return unsupported("this moelora was built without CUDA (configure with -DMOELORA_CUDA=ON on a machine with nvcc)");
#endif
  }
  return invalid_argument("unknown backend '{}' (cpu, cpu-bf16 or cuda)", opts.name);
}

}  // namespace moelora
