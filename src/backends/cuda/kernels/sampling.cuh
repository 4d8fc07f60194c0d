// Token choice on the device from f32 logits [rows, vocab] (row stride ld).
//
// Per row r, with T = temperature[r] (nullptr or T <= 0: greedy):
// - greedy: id = argmax_i logits[i] (ties: lowest index), logprob = log_softmax(logits)[id];
// - sampling: id = argmax_i (logits[i] / T + G_i) with Gumbel noise G_i = -log(-log(U_i)), which
//   draws id from softmax(logits / T) exactly; U_i = philox_uniform(seed[r], step[r], i), Philox
//   4x32-10 keyed by the 64-bit seed with counter (i, step low, step high, 0). Equal (seed, step)
//   give equal tokens whatever the batch. logprob = log_softmax(logits / T)[id].
// In both cases max_logit[r] = logits[id] (raw). No top-k / top-p filtering (not implemented).
// NaN logits are never chosen unless the whole row is NaN (then id = 0).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moelora::cuda {

struct SampleParams {
  const float* logits = nullptr;
  int64_t ld = 0;
  int rows = 0;
  int vocab = 0;
  const float* temperature = nullptr;  // device [rows] or nullptr (all greedy)
  const uint64_t* seed = nullptr;      // device [rows] (needed when sampling)
  const uint64_t* step = nullptr;      // device [rows]
  int32_t* ids = nullptr;              // device [rows]
  float* max_logit = nullptr;          // device [rows] or nullptr
  float* logprob = nullptr;            // device [rows] or nullptr
};
void launch_sample(const SampleParams& p, cudaStream_t stream);

// Philox 4x32-10 (Salmon et al., SC'11), usable on host and device so tests can reproduce draws.
__host__ __device__ inline void philox4x32_10(uint32_t (&ctr)[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * ctr[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(p0);
    ctr[0] = n0, ctr[1] = n1, ctr[2] = n2, ctr[3] = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}
// U in (0, 1): 24 random bits, centred in their bucket.
__host__ __device__ inline float philox_uniform(uint64_t seed, uint64_t step, uint32_t i) {
  uint32_t c[4] = {i, static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u};
  philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<float>(c[0] >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace moelora::cuda
