// Standalone router top-k: 4 warps per block, one token per warp.
#include "backends/cuda/kernels/router.cuh"
#include "backends/cuda/kernels/router_device.cuh"

namespace moelora::cuda {

namespace {

constexpr int kRouterWarps = 4;

__global__ void __launch_bounds__(kRouterWarps * 32) router_topk_kernel(const __grid_constant__ RouterParams p) {
  extern __shared__ double router_smem[];
  pdl_wait();
  pdl_trigger();
  moe_detail::route_tokens_block(p, blockIdx.x * kRouterWarps, gridDim.x * kRouterWarps, router_smem);
}

}  // namespace

void router_topk(const RouterParams& p, cudaStream_t stream) {
  MOELORA_CHECK(p.E >= 1 && p.E <= 1024 && p.k >= 1 && p.k <= p.E && p.k <= 32);
  if (p.mode == RouterMode::kSigmoidGrouped)
    MOELORA_CHECK(p.bias && p.n_group >= 1 && p.n_group <= 32 && p.E % p.n_group == 0 && p.topk_group >= 1 &&
                  p.topk_group <= p.n_group);
  if (p.T == 0) return;
  const int blocks = (p.T + kRouterWarps - 1) / kRouterWarps;
  const size_t smem = p.mode == RouterMode::kSigmoidGrouped ? sizeof(double) * kRouterWarps * p.E : 0;
  moe_launch(router_topk_kernel, dim3(blocks), dim3(kRouterWarps * 32), smem, stream, p.pdl, p);
}

}  // namespace moelora::cuda
