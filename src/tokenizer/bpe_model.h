// The "model" part of a Hugging Face BPE tokenizer: the vocabulary and the ranked merges.
// It turns one pre-token (already in the model's alphabet, e.g. byte-level symbols) into ids
// by repeatedly merging the adjacent pair with the lowest rank, leftmost first.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "io/json_util.h"

namespace moelora {

class BpeModel {
 public:
  // `model` is the "model" object of tokenizer.json (type "BPE"). Merges may be written as
  // "a b" strings (tokenizers < 0.20) or ["a", "b"] pairs (which allow spaces inside tokens).
  static Result<BpeModel> from_json(const Json& model, std::string_view what);

  // Appends the ids of one pre-token.
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token of an id of the vocabulary, or nullptr.
  const std::string* id_to_token(int32_t id) const;
  // One past the highest id of the vocabulary.
  int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }
  size_t num_merges() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  // The initial symbols of a word: one per character, or byte-fallback / unknown tokens.
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;  // "" for ids the vocabulary skips
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  int32_t byte_fallback_ids_[256];  // <0xXX> tokens, -1 where absent
};

}  // namespace moelora
