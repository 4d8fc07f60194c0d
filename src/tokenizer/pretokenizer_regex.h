// The regexes of Split pre-tokenizers (and Replace normalizers), run by PCRE2 in UTF + UCP
// mode with JIT. Patterns in tokenizer.json are written for Oniguruma, the engine inside
// Hugging Face `tokenizers`; they need Unicode properties and look-ahead (RE2 cannot compile
// them). PCRE2 and Oniguruma agree on that syntax; where their shorthand classes differ we
// rewrite the pattern so that it matches what the library we reproduce matches.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

struct pcre2_real_code_8;

namespace moelora {

// Whose behaviour to reproduce where Hugging Face's libraries disagree with each other.
enum class TokenizerCompat {
  // Rust `tokenizers` (what transformers, vLLM and the model's training used): Oniguruma's
  // \s (Unicode White_Space, so U+0085 but not U+FEFF), case-insensitive groups with Unicode
  // case folding ('ſ matches (?i:'s)). The default.
  kHuggingFace,
  // transformers.js (and its fork @lenml/tokenizers, our id oracle): JavaScript's \s (U+FEFF
  // but not U+0085), `(?i:'s|...)` spelled out as ASCII [sS] alternatives, String.trim().
  kTransformersJs,
};

// Rewrites a tokenizer.json pattern for PCRE2: \s \S \d \D \w \W \h \H become explicit classes
// with the chosen library's meaning. Fails with a clear message for what cannot be rewritten
// (\S, \D, \W inside a character class; \Q...\E).
Result<std::string> translate_pattern(std::string_view pattern, TokenizerCompat compat);

class PretokenizerRegex {
 public:
  // `pattern` as written in tokenizer.json; `what` names it in error messages.
  static Result<std::shared_ptr<const PretokenizerRegex>> compile(std::string_view pattern, TokenizerCompat compat,
                                                                  std::string_view what);
  ~PretokenizerRegex();
  PretokenizerRegex(const PretokenizerRegex&) = delete;
  PretokenizerRegex& operator=(const PretokenizerRegex&) = delete;

  // Appends the byte range [start, end) of every non-empty match in `text` (valid UTF-8),
  // leftmost first, non-overlapping, as JavaScript's matchAll and Rust's find_iter do.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  PretokenizerRegex() = default;
  std::string pattern_;  // as written in tokenizer.json
  pcre2_real_code_8* code_ = nullptr;
};

}  // namespace moelora
