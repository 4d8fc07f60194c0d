// Op contract of token sampling: the data a sampling step reads and the math every backend does
// the same way. Backend::sample (backend.h) states the algorithm; the functions below are its
// building blocks, compiled for the host and (under nvcc) the device, so the CPU reference and
// the CUDA kernels compute each of them with the same IEEE operations.
//
// Why this formulation: every quantity that decides a token is an exact integer (fixed-point
// masses, their sums, comparisons) computed from one correctly rounded double exp per token, so
// the device reproduces the reference's tokens bit for bit except where a device exp differs from
// the host's by an ulp right at a rounding boundary; and the draw is one counter-based uniform per
// (seed, step), so a row's token never depends on the batch it shares. The draw is an inverse-CDF
// walk over the kept tokens in the order (one random number per row, not one per token): the device
// finds it with the same histogram passes as the top-k / top-p boundaries.
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
  // >= 0: the penalties' counts come from this penalty slot of the backend (see "Penalty slots"
  // below) instead of edits, and sampling counts the drawn token into it.
  int32_t penalty_slot = -1;
  bool has_processing() const { return restrict_to_allowed || !edits.empty() || penalty_slot >= 0; }
};

struct SampleOutput {
  int32_t token = 0;
  float logprob = 0.0f;  // log_softmax(raw logits)[token]
  std::vector<std::pair<int32_t, float>> top_logprobs;  // raw, by (logit desc, id asc)
};

constexpr int kMaxTopLogprobs = 20;

// ---- Penalty slots: a sequence's penalty counts kept by the backend (Backend::penalty_reset), so a
// penalised row carries only its per-step edits and its counts never cross from the host again.
// One cell per vocabulary token: bit 31 in_context (in prompt or output), bits 0..30 out_count
// (occurrences among the generated tokens). A row with penalty_slot samples exactly as the row
// whose edits are its own merged, token by token, with its slot's cells (penalty_slot_edits):
// the edits the host's counts would have given it (runtime/sampler.h).
constexpr uint32_t kPenaltyInContext = 0x80000000u;

// The repetition penalty reads in_context; frequency and presence read out_count.
MOELORA_HD bool penalty_wants_context(float repetition) { return repetition != 1.0f; }
MOELORA_HD bool penalty_wants_output(float presence, float frequency) { return frequency != 0.0f || presence != 0.0f; }
// Whether a token's cell gives it an edit: in context under a repetition penalty, or generated at
// least once under a frequency or presence penalty.
MOELORA_HD bool penalty_cell_edits(uint32_t cell, bool ctx, bool out) {
  return (ctx && (cell & kPenaltyInContext) != 0) || (out && (cell & ~kPenaltyInContext) != 0);
}
// `e` (the row's own edit of the token, or a default one) with the cell's counts in the fields
// the row's penalties read.
MOELORA_HD LogitEdit penalty_merge(LogitEdit e, uint32_t cell, bool ctx, bool out) {
  if (ctx) e.in_context = (cell & kPenaltyInContext) != 0 ? 1 : 0;
  if (out) e.out_count = static_cast<int32_t>(cell & ~kPenaltyInContext);
  return e;
}
// A cell after its token was drawn (or appended): in context, one more occurrence if generated.
MOELORA_HD uint32_t penalty_count(uint32_t cell, bool generated) { return (cell + (generated ? 1u : 0u)) | kPenaltyInContext; }

// A slot's cells after Backend::penalty_reset(tokens, prompt_len) (host form of the contract).
inline void penalty_reset_cells(uint32_t* cells, int vocab, const std::vector<int32_t>& tokens, int prompt_len) {
  for (int t = 0; t < vocab; ++t) cells[t] = 0;
  for (size_t i = 0; i < tokens.size(); ++i) cells[tokens[i]] = penalty_count(cells[tokens[i]], static_cast<int>(i) >= prompt_len);
}

// The edits a row with a penalty slot samples with: its own, merged with `cells` [vocab], sorted by
// token (host; the CPU backend samples from these, the GPU tests compare against them).
inline std::vector<LogitEdit> penalty_slot_edits(const SampleRow& r, const uint32_t* cells, int vocab) {
  const bool ctx = penalty_wants_context(r.repetition), out = penalty_wants_output(r.presence, r.frequency);
  std::vector<LogitEdit> merged;
  size_t e = 0;
  for (int32_t t = 0; t < vocab; ++t) {
    const bool own = e < r.edits.size() && r.edits[e].token == t;
    if (!own && !penalty_cell_edits(cells[t], ctx, out)) continue;
    LogitEdit m;
    if (own) m = r.edits[e++];
    m.token = t;
    merged.push_back(penalty_merge(m, cells[t], ctx, out));
  }
  merged.insert(merged.end(), r.edits.begin() + e, r.edits.end());  // unsorted or outside the vocabulary: the caller refuses them
  return merged;
}

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
// row are exact integers (< 2^50 for any vocabulary under 2^18 tokens) whatever the order. vmax is
// the row's largest finite value; a non-finite v (banned -inf, +inf, NaN) has no mass.
MOELORA_HD uint64_t mass_q32(float v, float vmax, double inv_t) {
  if (!(v > -INFINITY && v < INFINITY)) return 0;
  const double e = exp((static_cast<double>(v) - static_cast<double>(vmax)) * inv_t);
  return static_cast<uint64_t>(e * 4294967296.0 + 0.5);
}

// The value whose order_key is `key` (its inverse; key 0, NaN, gives a NaN).
MOELORA_HD float key_value(uint32_t key) {
  const uint32_t u = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  __builtin_memcpy(&v, &u, 4);
  return v;
#endif
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

// The draw of a row: 53 random bits keyed by the request's seed, counted by the step (a stream of
// its own: the counter's last word).
MOELORA_HD uint64_t draw_bits(uint64_t seed, uint64_t step) {
  uint32_t c[4] = {0u, static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0x44524157u};
  philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return ((static_cast<uint64_t>(c[0]) << 32) | c[1]) >> 11;
}

// floor(bits * total / 2^53) for bits < 2^53: a uniform integer in [0, total) (total < 2^64; exact,
// no floating point). The drawn token is the first of the order whose cumulative kept mass exceeds it.
MOELORA_HD uint64_t draw_target(uint64_t bits, uint64_t total) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(bits << 11, total);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * total) >> 53);
#endif
}

}  // namespace sampling
}  // namespace moelora
