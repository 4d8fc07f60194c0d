// What the CUDA backend needs to know about the device it runs on.
#pragma once

#include <string>

namespace moelora::cuda {

struct DeviceInfo {
  bool available = false;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int num_sms = 0;
  size_t l2_bytes = 0;
  size_t total_memory = 0;
  size_t max_smem_per_block_optin = 0;
};

// Properties of the current device; `available` is false when there is none.
DeviceInfo query_device();

}  // namespace moelora::cuda
