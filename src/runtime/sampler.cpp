#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace moelora {

namespace {

// The edit of token t, created (sorted by token, as the contract asks) on first use.
LogitEdit& edit_of(std::map<int32_t, LogitEdit>& edits, int32_t t) {
  LogitEdit& e = edits[t];
  e.token = t;
  return e;
}

// Which counts a request's penalties read (the same rule the penalty slots apply: ops/sampling.h).
bool wants_context(const SamplingParams& p) { return penalty_wants_context(p.repetition_penalty); }
bool wants_output(const SamplingParams& p) { return penalty_wants_output(p.presence_penalty, p.frequency_penalty); }

// Everything but the penalties' counts: per-step edits (bias, allowed, min_tokens, bad_words).
SampleRow row_without_counts(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens,
                             int prompt_len, const std::vector<int>& eos_ids, int vocab,
                             std::map<int32_t, LogitEdit>& edits) {
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

  auto edit = [&](int32_t t) -> LogitEdit& { return edit_of(edits, t); };
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
  return r;
}

}  // namespace

SampleRow make_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens, int prompt_len,
                          const std::vector<int>& eos_ids, int vocab) {
  std::map<int32_t, LogitEdit> edits;  // ordered by token: the contract asks for sorted edits
  SampleRow r = row_without_counts(p, seed, tokens, prompt_len, eos_ids, vocab, edits);
  auto edit = [&](int32_t t) -> LogitEdit& { return edit_of(edits, t); };
  if (wants_context(p))
    for (int32_t t : tokens) edit(t).in_context = 1;
  if (wants_output(p))
    for (size_t i = prompt_len; i < tokens.size(); ++i) edit(tokens[i]).out_count++;
  r.edits.reserve(edits.size());
  for (const auto& [t, e] : edits) r.edits.push_back(e);
  return r;
}

void PenaltyCounts::sync(const SamplingParams& p, const std::vector<int32_t>& tokens, int prompt_len) {
  if (!wants_context(p) && !wants_output(p)) return;
  if (tokens.size() < seen_) {
    counts_.clear();
    seen_ = 0;
  }
  const bool bulk = tokens.size() - seen_ > 64;  // a prompt: sort once instead of inserting one by one
  if (bulk) {
    for (size_t i = seen_; i < tokens.size(); ++i) {
      LogitEdit e;
      e.token = tokens[i];
      e.in_context = 1;
      e.out_count = static_cast<int>(i) >= prompt_len ? 1 : 0;
      counts_.push_back(e);
    }
    std::stable_sort(counts_.begin(), counts_.end(), [](const LogitEdit& a, const LogitEdit& b) { return a.token < b.token; });
    size_t w = 0;  // merge duplicates
    for (size_t r = 0; r < counts_.size(); ++r) {
      if (w > 0 && counts_[w - 1].token == counts_[r].token) counts_[w - 1].out_count += counts_[r].out_count;
      else counts_[w++] = counts_[r];
    }
    counts_.resize(w);
  } else {
    for (size_t i = seen_; i < tokens.size(); ++i) {
      const int32_t t = tokens[i];
      auto it = std::lower_bound(counts_.begin(), counts_.end(), t,
                                 [](const LogitEdit& e, int32_t v) { return e.token < v; });
      if (it == counts_.end() || it->token != t) {
        LogitEdit e;
        e.token = t;
        e.in_context = 1;
        it = counts_.insert(it, e);
      }
      if (static_cast<int>(i) >= prompt_len) ++it->out_count;
    }
  }
  seen_ = tokens.size();
}

SampleRow make_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens, int prompt_len,
                          const std::vector<int>& eos_ids, int vocab, const PenaltyCounts& counts) {
  const bool ctx = wants_context(p), out = wants_output(p);
  if (!ctx && !out) return make_sample_row(p, seed, tokens, prompt_len, eos_ids, vocab);
  std::map<int32_t, LogitEdit> edits;
  SampleRow r = row_without_counts(p, seed, tokens, prompt_len, eos_ids, vocab, edits);
  // Merge the two token-ordered sequences (the per-step edits are few; the counts are many).
  r.edits.reserve(edits.size() + counts.counts().size());
  auto e = edits.begin();
  for (const LogitEdit& c : counts.counts()) {
    const int32_t t = c.token;
    if (!ctx && c.out_count == 0) continue;  // only the prompt has it: no penalty applies
    for (; e != edits.end() && e->first < t; ++e) r.edits.push_back(e->second);
    LogitEdit m;
    if (e != edits.end() && e->first == t) m = (e++)->second;
    m.token = t;
    if (ctx) m.in_context = c.in_context;
    if (out) m.out_count = c.out_count;
    r.edits.push_back(m);
  }
  for (; e != edits.end(); ++e) r.edits.push_back(e->second);
  return r;
}

bool wants_penalty_counts(const SamplingParams& p) { return wants_context(p) || wants_output(p); }

SampleRow make_slot_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens,
                               int prompt_len, const std::vector<int>& eos_ids, int vocab, int penalty_slot) {
  std::map<int32_t, LogitEdit> edits;
  SampleRow r = row_without_counts(p, seed, tokens, prompt_len, eos_ids, vocab, edits);
  r.edits.reserve(edits.size());
  for (const auto& [t, e] : edits) r.edits.push_back(e);
  r.penalty_slot = penalty_slot;
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
