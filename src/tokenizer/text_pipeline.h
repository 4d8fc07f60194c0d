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
  // `*first_at_start` says whether pieces[0] begins at offset 0 of the original input (Rust's
  // offsets_original().0 == 0), which Metaspace's prepend_scheme "first" depends on; a stage
  // that cuts text off the front of pieces[0] clears it.
  virtual void pre_tokenize(std::vector<std::string>& pieces, bool* first_at_start) const = 0;
};

// Supported: Split (Regex or String pattern, every delimiter behaviour, invert), ByteLevel
// (add_prefix_space, use_regex), Metaspace (replacement, prepend_scheme or the older
// add_prefix_space, split) and Sequence of those. A JSON null gives a null pointer.
Result<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const Json& config, TokenizerCompat compat,
                                                         std::string_view what);

// How a Split pre-tokenizer treats the delimiters it finds (Hugging Face's names).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The pieces of `text` around the matched delimiters `matches` (sorted, non-overlapping byte
// ranges), following Rust tokenizers' NormalizedString::split; `invert` swaps the roles of
// matches and gaps. Exposed for tests. `first_begin`, if given, gets the offset where the first
// piece begins (text.size() when there is none).
std::vector<std::string> split_by_matches(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                                          SplitBehavior behavior, bool invert, size_t* first_begin = nullptr);

}  // namespace moelora
