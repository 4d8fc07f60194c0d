// Token sampling from one row of logits. Each request owns its random generator, seeded from
// its `seed`, so a request's tokens never depend on what else shares its batch.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "runtime/engine.h"

namespace moelora {

struct SampleResult {
  int32_t token = 0;
  float logprob = 0;  // log-softmax of the raw logits (temperature 1) at the chosen token
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

// temperature 0: argmax (lowest id on ties). Otherwise softmax(logits / T), then top-k, top-p
// (smallest set of most likely tokens whose mass reaches p), min-p (drop tokens below
// min_p * max prob), renormalise, draw one token with `rng`.
SampleResult sample_token(const float* logits, int vocab, const SamplingParams& p, std::mt19937_64& rng);

}  // namespace moelora
