#include "runtime/sampler.h"

#include <cmath>
#include <map>

namespace moelora {

SampleRow make_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens, int prompt_len,
                          const std::vector<int>& eos_ids, int vocab) {
  SampleRow r;
  r.temperature = p.temperature;
  r.top_k = p.top_k;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.seed = seed;
  r.step = static_cast<uint64_t>(tokens.size()) - static_cast<uint64_t>(prompt_len);
  r.logprobs = p.logprobs;
  r.presence = p.presence_penalty;
  r.frequency = p.frequency_penalty;
  r.repetition = p.repetition_penalty;
  r.restrict_to_allowed = !p.allowed_token_ids.empty();

  std::map<int32_t, LogitEdit> edits;  // ordered by token: the contract asks for sorted edits
  auto edit = [&](int32_t t) -> LogitEdit& {
    LogitEdit& e = edits[t];
    e.token = t;
    return e;
  };
  for (const auto& [t, b] : p.logit_bias) edit(t).bias += b;
  for (int32_t t : p.allowed_token_ids) edit(t).allowed = 1;
  const int generated = static_cast<int>(tokens.size()) - prompt_len;
  if (generated < p.min_tokens) {
    if (!p.ignore_eos)
      for (int t : eos_ids)
        if (t >= 0 && t < vocab) edit(t).banned = 1;
    for (int32_t t : p.stop_token_ids)  // ids outside the vocabulary can never be generated anyway
      if (t >= 0 && t < vocab) edit(t).banned = 1;
  }
  for (const std::vector<int32_t>& w : p.bad_words) {
    if (w.empty()) continue;
    const int pre = static_cast<int>(w.size()) - 1;
    if (pre > generated) continue;
    bool match = true;
    for (int i = 0; i < pre && match; ++i) match = tokens[tokens.size() - pre + i] == w[i];
    if (match) edit(w.back()).banned = 1;
  }
  if (p.repetition_penalty != 1.0f)
    for (int32_t t : tokens) edit(t).in_context = 1;
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
    for (size_t i = prompt_len; i < tokens.size(); ++i) edit(tokens[i]).out_count++;
  r.edits.reserve(edits.size());
  for (const auto& [t, e] : edits) r.edits.push_back(e);
  return r;
}

Status validate_sampling(const SamplingParams& p, int vocab) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return invalid_argument("temperature must be a finite number >= 0, got {}", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return invalid_argument("top_p must be in (0, 1], got {}", p.top_p);
  if (p.top_k < 0) return invalid_argument("top_k must be >= 0 (0 disables it), got {}", p.top_k);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return invalid_argument("min_p must be in [0, 1], got {}", p.min_p);
  if (p.max_tokens < 1) return invalid_argument("max_tokens must be at least 1, got {}", p.max_tokens);
  if (p.logprobs < 0 || p.logprobs > kMaxTopLogprobs)
    return invalid_argument("logprobs must be in [0, {}], got {}", kMaxTopLogprobs, p.logprobs);
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    return invalid_argument("presence_penalty must be in [-2, 2], got {}", p.presence_penalty);
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    return invalid_argument("frequency_penalty must be in [-2, 2], got {}", p.frequency_penalty);
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= 2.0f))
    return invalid_argument("repetition_penalty must be in (0, 2], got {}", p.repetition_penalty);
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens)
    return invalid_argument("min_tokens must be in [0, max_tokens = {}], got {}", p.max_tokens, p.min_tokens);
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab; };
  for (const auto& [t, b] : p.logit_bias) {
    if (!in_vocab(t)) return invalid_argument("logit_bias: token id {} is outside the vocabulary (0..{})", t, vocab - 1);
    if (!(b >= -100.0f && b <= 100.0f)) return invalid_argument("logit_bias: bias {} of token {} is outside [-100, 100]", b, t);
  }
  for (int32_t t : p.allowed_token_ids)
    if (!in_vocab(t)) return invalid_argument("allowed_token_ids: token id {} is outside the vocabulary (0..{})", t, vocab - 1);
  for (const auto& w : p.bad_words)
    for (int32_t t : w)
      if (!in_vocab(t)) return invalid_argument("bad_words: token id {} is outside the vocabulary (0..{})", t, vocab - 1);
  return {};
}

}  // namespace moelora
