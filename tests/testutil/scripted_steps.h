// Scripted forward steps for model-level tests that compare two ways of running the same batch
// (sharded vs single device, absorbed vs decompressed MLA): every sequence's prompt is prefilled
// (whole, or its first `first_chunk` tokens in one step and the rest in the next), then `decode`
// steps feed one token per sequence (`fed_token(d, s)`). Each sequence gets its own contiguous
// pages, enough for prompt + decode; every token returns logits.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "ops/types.h"

namespace moelora::testutil {

struct ScriptedSeq {
  std::vector<int32_t> prompt;
  int slot = -1;  // adapter slot, -1 = base model
};

struct ScriptedSteps {
  std::vector<StepBatch> steps;
  int num_pages = 0;
};

// first_chunk 0: one prefill step; > 0: two (the second holds the tokens from first_chunk on).
inline ScriptedSteps scripted_steps(const std::vector<ScriptedSeq>& seqs, int page_size, int decode, int first_chunk,
                                    const std::function<int32_t(int d, int s)>& fed_token) {
  ScriptedSteps out;
  std::vector<std::vector<int32_t>> pages(seqs.size());
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int p = 0; p < (static_cast<int>(seqs[s].prompt.size()) + decode + page_size - 1) / page_size; ++p)
      pages[s].push_back(out.num_pages++);
  const int prefill_steps = first_chunk > 0 ? 2 : 1;
  out.steps.resize(prefill_steps + decode);
  for (StepBatch& b : out.steps) b.seq_pages = pages;
  auto add = [](StepBatch& b, int32_t id, int pos, int seq, int slot) {
    b.logit_rows.push_back(b.num_tokens());
    b.token_ids.push_back(id);
    b.positions.push_back(pos);
    b.token_seq.push_back(seq);
    b.token_slot.push_back(slot);
  };
  for (size_t s = 0; s < seqs.size(); ++s)
    for (size_t i = 0; i < seqs[s].prompt.size(); ++i)
      add(out.steps[first_chunk > 0 && static_cast<int>(i) >= first_chunk ? 1 : 0], seqs[s].prompt[i],
          static_cast<int>(i), static_cast<int>(s), seqs[s].slot);
  for (int d = 0; d < decode; ++d)
    for (size_t s = 0; s < seqs.size(); ++s)
      add(out.steps[prefill_steps + d], fed_token(d, static_cast<int>(s)), static_cast<int>(seqs[s].prompt.size()) + d,
          static_cast<int>(s), seqs[s].slot);
  return out;
}

}  // namespace moelora::testutil
