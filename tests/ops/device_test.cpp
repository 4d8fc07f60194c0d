// The op suite's first check: the device is the Hopper part the kernels are built for.
#include "backends/cuda/device_info.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {

TEST(Device, IsHopper) {
  MOELORA_REQUIRE_GPU();
  const cuda::DeviceInfo d = cuda::query_device();
  ASSERT_TRUE(d.available);
  EXPECT_EQ(d.sm_major, 9) << d.name;
  EXPECT_GT(d.num_sms, 0);
  std::printf("device: %s, %d SMs, L2 %zu MB, %zu GB\n", d.name.c_str(), d.num_sms, d.l2_bytes >> 20,
              d.total_memory >> 30);
}

}  // namespace moelora::ops_test
