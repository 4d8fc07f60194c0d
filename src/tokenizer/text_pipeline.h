// The normalizer and pre-tokenizer stages of a tokenizer.json pipeline. Each stage is built
// from its JSON object; a type we do not implement is a clear kUnsupported error at load time,
// never a silently different tokenization.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/json_util.h"
#include "tokenizer/pretokenizer_regex.h"

namespace moelora {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // `text` and the result are valid UTF-8.
  virtual std::string normalize(std::string text) const = 0;
};

// Supported: NFC, NFD, Lowercase, Replace, Prepend, Strip and Sequence of those. A JSON null
// gives a null pointer (no normalization).
Result<std::unique_ptr<Normalizer>> make_normalizer(const Json& config, TokenizerCompat compat,
                                                    std::string_view what);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces each piece by the pieces it splits into (empty pieces are dropped).
  virtual void pre_tokenize(std::vector<std::string>& pieces) const = 0;
};

// Supported: Split (Regex or String pattern, every delimiter behaviour, invert), ByteLevel
// (add_prefix_space, use_regex) and Sequence of those. A JSON null gives a null pointer.
Result<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const Json& config, TokenizerCompat compat,
                                                         std::string_view what);

// How a Split pre-tokenizer treats the delimiters it finds (Hugging Face's names).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The pieces of `text` around the matched delimiters `matches` (sorted, non-overlapping byte
// ranges), following Rust tokenizers' NormalizedString::split; `invert` swaps the roles of
// matches and gaps. Exposed for tests.
std::vector<std::string> split_by_matches(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                                          SplitBehavior behavior, bool invert);

}  // namespace moelora
