// The host half of sampling: a request's SamplingParams and its tokens so far become the SampleRow
// that Backend::sample reads (ops/sampling.h): the logit processors as sparse per-token edits.
// Tokens depend only on the request (its seed, its own tokens, its step), never on the batch.
#pragma once

#include <cstdint>
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

// Checks a request's sampling values against the vocabulary (ranges as vLLM's).
Status validate_sampling(const SamplingParams& p, int vocab);

}  // namespace moelora
