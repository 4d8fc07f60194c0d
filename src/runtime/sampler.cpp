#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moelora {

SampleResult sample_token(const float* logits, int vocab, const SamplingParams& p, std::mt19937_64& rng) {
  SampleResult r;
  double mx = -INFINITY;
  for (int i = 0; i < vocab; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double z = 0;
  for (int i = 0; i < vocab; ++i) z += std::exp(logits[i] - mx);
  const double log_z = mx + std::log(z);
  auto logprob = [&](int i) { return static_cast<float>(logits[i] - log_z); };

  if (p.temperature <= 0.0f) {
    int best = 0;
    for (int i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    r.token = best;
  } else {
    // Candidates sorted by probability (ties: lower id first) for top-k / top-p.
    std::vector<int> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    int keep = vocab;
    if (p.top_k > 0) keep = std::min(keep, p.top_k);
    std::vector<double> prob(keep);
    const double inv_t = 1.0 / p.temperature;
    const double top = logits[order[0]] * inv_t;
    double sum = 0;
    for (int i = 0; i < keep; ++i) sum += (prob[i] = std::exp(logits[order[i]] * inv_t - top));
    for (double& q : prob) q /= sum;
    if (p.top_p < 1.0f) {
      double cum = 0;
      int n = 0;
      while (n < keep) {
        cum += prob[n++];
        if (cum >= p.top_p) break;
      }
      keep = std::max(1, n);
    }
    if (p.min_p > 0.0f) {
      const double floor = p.min_p * prob[0];
      int n = 1;
      while (n < keep && prob[n] >= floor) ++n;
      keep = n;
    }
    double mass = 0;
    for (int i = 0; i < keep; ++i) mass += prob[i];
    const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
    double acc = 0;
    int pick = keep - 1;
    for (int i = 0; i < keep; ++i) {
      acc += prob[i];
      if (u < acc) {
        pick = i;
        break;
      }
    }
    r.token = order[pick];
  }
  r.logprob = logprob(r.token);
  if (p.logprobs > 0) {
    const int n = std::min(p.logprobs, vocab);
    std::vector<int> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                      [&](int a, int b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; });
    for (int i = 0; i < n; ++i) r.top_logprobs.emplace_back(idx[i], logprob(idx[i]));
  }
  return r;
}

}  // namespace moelora
