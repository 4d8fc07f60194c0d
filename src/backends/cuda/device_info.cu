#include "backends/cuda/device_info.h"

#include <cuda_runtime.h>

namespace moelora::cuda {

DeviceInfo query_device() {
  DeviceInfo info;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return info;
  }
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) return info;
  info.available = true;
  info.name = p.name;
  info.sm_major = p.major;
  info.sm_minor = p.minor;
  info.num_sms = p.multiProcessorCount;
  info.l2_bytes = p.l2CacheSize;
  info.total_memory = p.totalGlobalMem;
  info.max_smem_per_block_optin = p.sharedMemPerBlockOptin;
  return info;
}

}  // namespace moelora::cuda
