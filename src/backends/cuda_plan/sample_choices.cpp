#include "backends/cuda_plan/sample_choices.h"

namespace moelora::cuda_plan {

namespace {
// One wave's time (us) on 1, 2, 4, 8, 16 blocks per row (1 block: unused), H200, 2026-12-06
// (sample_choices.h): a wave holding one row, and a full wave (fitted from 256 rows).
constexpr std::array<double, 5> kOneRowUs{0.0, 183.4, 102.0, 61.2, 47.6};
constexpr std::array<double, 5> kFullWaveUs{0.0, 287.6, 137.3, 85.7, 67.3};
}  // namespace

double sample_batch_us(int rows, int size_index, int max_active) {
  const int full = rows / max_active, rest = rows % max_active;
  const double one = kOneRowUs[size_index], whole = kFullWaveUs[size_index];
  double us = full * whole;
  // A partial wave of `rest` rows, from one row alone (rest 1) towards a full wave.
  if (rest > 0) us += one + (whole - one) * static_cast<double>(rest - 1) / static_cast<double>(max_active - 1);
  return us;
}

int choose_sample_cluster(int rows, const std::array<int, 5>& max_active) {
  int best = 2;
  double best_cost = 0.0;
  for (int i = 1; i <= 4; ++i) {
    if (max_active[i] <= 0) continue;
    const double cost = sample_batch_us(rows, i, max_active[i]);
    if (best_cost == 0.0 || cost < best_cost) best = 1 << i, best_cost = cost;  // ties keep the smaller
  }
  return best;
}

}  // namespace moelora::cuda_plan
