// The host half of sampling: a request's SamplingParams and its tokens so far become the SampleRow
// that Backend::sample reads (ops/sampling.h): the logit processors as sparse per-token edits.
// Tokens depend only on the request (its seed, its own tokens, its step), never on the batch.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/sampling.h"
#include "runtime/engine.h"

namespace moelora {

// `tokens` = prompt + generated (the first `prompt_len` are the prompt); `eos_ids` the model's.
// Edits, in vLLM's meaning:
//  - logit_bias: bias of the token;  allowed_token_ids: restrict_to_allowed + `allowed` edits;
//  - min_tokens: while fewer were generated, the EOS ids (unless ignore_eos) and stop_token_ids
//    are banned;  bad_words: a one-token word is always banned; a longer one bans its last token
//    when the generated tokens end with the rest of it;
//  - repetition_penalty != 1: in_context for every token of prompt and output;
//  - frequency/presence != 0: out_count of every generated token.
SampleRow make_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens, int prompt_len,
                          const std::vector<int>& eos_ids, int vocab);

// What the repetition / frequency / presence penalties need from a sequence's tokens, kept up to
// date as tokens are appended: recounting the whole context every step cost O(context log
// context) per penalised row per step on the engine thread (a 4k-token prompt with
// repetition_penalty: ~4k map insertions per step). One per sequence; sync() reads only the
// tokens appended since its last call.
class PenaltyCounts {
 public:
  // Catches up with `tokens` (prompt + generated, the first `prompt_len` the prompt). A shorter
  // `tokens` than seen before (never in the engine) starts over.
  void sync(const SamplingParams& p, const std::vector<int32_t>& tokens, int prompt_len);
  // One edit per distinct token seen, sorted by token, with in_context = 1 and out_count = its
  // occurrences among the generated tokens (other fields zero). A sorted vector, not a map: the
  // row builder copies it every step, and a flat copy is ~10x cheaper than walking a tree.
  const std::vector<LogitEdit>& counts() const { return counts_; }

 private:
  std::vector<LogitEdit> counts_;
  size_t seen_ = 0;
};

// The same row, with the penalties' counts taken from `counts` (synced to `tokens`) instead of a
// recount: identical result, O(distinct tokens) per step.
SampleRow make_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens, int prompt_len,
                          const std::vector<int>& eos_ids, int vocab, const PenaltyCounts& counts);

// Whether a request's penalties read token counts (repetition, frequency or presence penalty).
bool wants_penalty_counts(const SamplingParams& p);

// The row of a sequence whose counts the backend keeps in penalty slot `penalty_slot`
// (Backend::penalty_reset; ops/sampling.h): only the per-step edits (bias, allowed, min_tokens,
// bad_words) are built here, O(those) per step whatever the context length. Samples exactly as the
// row from PenaltyCounts does when the slot counts the same tokens.
SampleRow make_slot_sample_row(const SamplingParams& p, uint64_t seed, const std::vector<int32_t>& tokens,
                               int prompt_len, const std::vector<int>& eos_ids, int vocab, int penalty_slot);

// The free penalty slots of a backend (touched by the engine thread only) and how many are held
// (read by stats() from any thread).
struct PenaltySlotPool {
  std::vector<int> free;
  std::atomic<int> used{0};
};

// A backend penalty slot held by one sequence, given back to its pool when the sequence ends,
// however it ends (finished, cancelled, failed, engine stopping). Engine thread only.
class PenaltySlotLease {
 public:
  PenaltySlotLease() = default;
  // A free slot of `pool`, or an empty lease (slot() < 0) when none is free.
  static PenaltySlotLease take(const std::shared_ptr<PenaltySlotPool>& pool) {
    PenaltySlotLease l;
    if (!pool || pool->free.empty()) return l;
    l.pool_ = pool;
    l.slot_ = pool->free.back();
    pool->free.pop_back();
    pool->used.fetch_add(1);
    return l;
  }
  PenaltySlotLease(PenaltySlotLease&& o) noexcept : pool_(std::move(o.pool_)), slot_(o.slot_) { o.slot_ = -1; }
  PenaltySlotLease& operator=(PenaltySlotLease&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = std::move(o.pool_);
      slot_ = o.slot_;
      o.slot_ = -1;
    }
    return *this;
  }
  PenaltySlotLease(const PenaltySlotLease&) = delete;
  PenaltySlotLease& operator=(const PenaltySlotLease&) = delete;
  ~PenaltySlotLease() { release(); }
  int slot() const { return slot_; }

 private:
  void release() {
    if (pool_ && slot_ >= 0) {
      pool_->free.push_back(slot_);
      pool_->used.fetch_sub(1);
    }
    slot_ = -1;
  }
  std::shared_ptr<PenaltySlotPool> pool_;
  int slot_ = -1;
};

// Checks a request's sampling values against the vocabulary (ranges as vLLM's).
Status validate_sampling(const SamplingParams& p, int vocab);

}  // namespace moelora
