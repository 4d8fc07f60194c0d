// Op contract of token sampling: the data a sampling step reads and the math every backend does
// the same way. Backend::sample (backend.h) states the algorithm; the functions below are its
// building blocks, compiled for the host and (under nvcc) the device, so the CPU reference and
// the CUDA kernels compute each of them with the same IEEE operations.
//
// Why this formulation (and not a sort plus an inverse-CDF draw with a per-request generator):
// every quantity that decides a token is either exact (integer masses, comparisons) or one
// correctly rounded double operation away from exact, so the device reproduces the reference's
// tokens bit for bit except where a double exp/log differs by an ulp right at a decision
// boundary; and the draw depends only on (seed, step, token id), never on the batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define MOELORA_HD __host__ __device__ __forceinline__
#else
#define MOELORA_HD inline
#endif

namespace moelora {

// What the logit processors do to one token of one row (host-built, see runtime/sampler.h).
// Applied to the raw logit v in this order (float arithmetic, each operation rounded):
//   v += bias;  if banned: v = -inf;
//   if in_context (token in prompt or output, repetition penalty): v = v > 0 ? v / rep : v * rep;
//   if out_count > 0: v -= frequency * out_count + presence.
struct LogitEdit {
  int32_t token = 0;
  float bias = 0.0f;
  int32_t out_count = 0;   // occurrences among the generated tokens
  uint8_t in_context = 0;  // in prompt or output (repetition penalty applies)
  uint8_t banned = 0;      // bad word completion or EOS/stop before min_tokens
  uint8_t allowed = 0;     // listed in allowed_token_ids (see SampleRow::restrict_to_allowed)
};

// One row of logits to sample from.
struct SampleRow {
  float temperature = 1.0f;  // <= 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off
  uint64_t seed = 0;         // the request's
  uint64_t step = 0;         // tokens the request generated before this one
  int logprobs = 0;          // top alternatives to report (raw distribution), <= kMaxTopLogprobs
  float presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
  bool restrict_to_allowed = false;  // tokens without an `allowed` edit are banned
  std::vector<LogitEdit> edits;      // sorted by token, one per token
  bool has_processing() const { return restrict_to_allowed || !edits.empty(); }
};

struct SampleOutput {
  int32_t token = 0;
  float logprob = 0.0f;  // log_softmax(raw logits)[token]
  std::vector<std::pair<int32_t, float>> top_logprobs;  // raw, by (logit desc, id asc)
};

constexpr int kMaxTopLogprobs = 20;

namespace sampling {

// Float multiply without fused multiply-add contraction on the device (the host build has none).
MOELORA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOELORA_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MOELORA_HD float apply_edit(float v, const LogitEdit& e, float presence, float frequency, float repetition) {
  v = add_rn(v, e.bias);
  if (e.banned) v = -INFINITY;
  if (e.in_context && repetition != 1.0f) v = v > 0.0f ? v / repetition : mul_rn(v, repetition);
  if (e.out_count > 0) v = add_rn(v, -add_rn(mul_rn(frequency, static_cast<float>(e.out_count)), presence));
  return v;
}

// Order of tokens by logit: a larger key is a better token (NaN sorts below -inf). Equal keys
// are ordered by token id, lower first.
MOELORA_HD uint32_t order_key(float v) {
  if (v != v) return 0u;
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(v);
#else
  __builtin_memcpy(&u, &v, 4);
#endif
  if (v == 0.0f) u = 0u;  // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Probability mass of a token in fixed point: round(exp((v - vmax) / T) * 2^32), so sums over a
// row are exact integers (< 2^50 for any vocabulary under 2^18 tokens) whatever the order.
MOELORA_HD uint64_t mass_q32(float v, float vmax, double inv_t) {
  if (!(v > -INFINITY)) return 0;
  const double e = exp((static_cast<double>(v) - static_cast<double>(vmax)) * inv_t);
  return static_cast<uint64_t>(e * 4294967296.0 + 0.5);
}

// Philox 4x32-10 (Salmon et al., SC'11).
MOELORA_HD void philox4x32_10(uint32_t (&ctr)[4], uint32_t k0, uint32_t k1) {
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

// U in (0, 1) with 53 random bits, keyed by the request's seed, counted by (token, step).
MOELORA_HD double uniform(uint64_t seed, uint64_t step, uint32_t token) {
  uint32_t c[4] = {token, static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0x5A4D504Cu};
  philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = ((static_cast<uint64_t>(c[0]) << 32) | c[1]) >> 11;
  return (static_cast<double>(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

// Gumbel-max key: argmax over the kept tokens of v / T + G draws exactly from softmax(v / T)
// restricted to them. `gumbel_key_of` takes the token's uniform draw u (the device computes u once
// and only evaluates this exact key for tokens a cheaper estimate cannot rule out).
MOELORA_HD double gumbel_key_of(float v, double inv_t, double u) {
  const double g = -log(-log(u));
#if defined(__CUDA_ARCH__)
  return __dadd_rn(__dmul_rn(static_cast<double>(v), inv_t), g);  // no fused multiply-add: as the host
#else
  return static_cast<double>(v) * inv_t + g;
#endif
}
MOELORA_HD double gumbel_key(float v, double inv_t, uint64_t seed, uint64_t step, uint32_t token) {
  return gumbel_key_of(v, inv_t, uniform(seed, step, token));
}

}  // namespace sampling
}  // namespace moelora
