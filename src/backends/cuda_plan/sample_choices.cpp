#include "backends/cuda_plan/sample_choices.h"

namespace moelora::cuda_plan {

namespace {
// One row's time (us) on 1, 2, 4, 8, 16 blocks, H200 run 3 (sample_choices.h); 1 block: unused.
constexpr std::array<double, 5> kRowUs{0.0, 753.3, 390.9, 210.1, 134.6};
}  // namespace

int choose_sample_cluster(int rows, const std::array<int, 5>& max_active) {
  int best = 2;
  double best_cost = 0.0;
  for (int i = 1; i <= 4; ++i) {
    if (max_active[i] <= 0) continue;
    const double cost = static_cast<double>((rows + max_active[i] - 1) / max_active[i]) * kRowUs[i];
    if (best_cost == 0.0 || cost < best_cost) best = 1 << i, best_cost = cost;  // ties keep the smaller
  }
  return best;
}

}  // namespace moelora::cuda_plan
