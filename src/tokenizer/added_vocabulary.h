// Added tokens ("<|im_start|>", "<think>", "<｜tool▁sep｜>"...): found in the text before the
// normal pipeline runs, so that normalization and pre-tokenization never break them apart.
// Matching is leftmost-longest over all contents, like the Aho-Corasick automaton of Rust
// tokenizers and the trie of transformers.js.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pretokenizer_regex.h"

namespace moelora {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;      // skipped by decode(skip_special_tokens)
  bool lstrip = false;       // swallows the white space on its left
  bool rstrip = false;       // swallows the white space on its right
  bool single_word = false;  // matches only between non-word characters
  bool normalized = false;   // matched in the normalized text rather than the raw text
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `normalized_contents[i]` is what tokens[i] looks like after normalization (used when the
  // token is normalized). With kTransformersJs every token is matched in the raw text, single_word
  // is ignored and lstrip/rstrip use JavaScript's white space, as transformers.js does.
  AddedTokenMatcher(const std::vector<AddedToken>& tokens, const std::vector<std::string>& normalized_contents,
                    bool match_normalized_tokens, TokenizerCompat compat);

  struct Segment {
    size_t begin, end;
    int32_t id;  // -1: ordinary text
  };
  // Covers `text` with ordinary segments and added-token segments, in order.
  void split(std::string_view text, std::vector<Segment>& segments) const;
  bool empty() const { return nodes_.size() <= 1; }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // byte -> node index
    int32_t token = -1;                                 // index into tokens_ of a content ending here
  };
  struct Match {
    int32_t token = -1;  // index into tokens_, -1: none
    size_t end = 0;
  };
  Match longest_match_at(std::string_view text, size_t pos) const;

  std::vector<Node> nodes_{Node{}};
  std::vector<AddedToken> tokens_;
  bool first_bytes_[256] = {};
  TokenizerCompat compat_ = TokenizerCompat::kHuggingFace;
  std::shared_ptr<const PretokenizerRegex> word_char_;  // for single_word
};

}  // namespace moelora
