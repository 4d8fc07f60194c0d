#include "backends/cuda_plan/sample_choices.h"

namespace moelora::cuda_plan {

int choose_sample_cluster(int rows, const std::array<int, 5>& max_active) {
  int best = 1;
  double best_cost = 0.0;
  for (int i = 4; i >= 0; --i) {
    if (max_active[i] <= 0) continue;
    const int c = 1 << i;
    const double cost = static_cast<double>((rows + max_active[i] - 1) / max_active[i]) / c;
    if (best_cost == 0.0 || cost < best_cost) best = c, best_cost = cost;  // ties keep the larger c
  }
  return best;
}

}  // namespace moelora::cuda_plan
