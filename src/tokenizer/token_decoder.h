// The "decoder" of a tokenizer.json, turned into what streaming needs: the text each token
// contributes on its own, plus the few rules that only concern the start of the output.
//
// Hugging Face runs the decoder over the whole token list (decode_chain). Every decoder moelora
// accepts is per token except three things at the start of the text, so we split it:
//  - per token: ByteLevel (symbols -> bytes), Replace ("▁" -> " "), ByteFallback ("<0x0A>" ->
//    one raw byte), Metaspace ("▁" -> " "), Strip placed before Fuse;
//  - the first token: Metaspace drops the replacement characters of token 0 (Rust drops all of
//    them, transformers.js one leading space), as SentencePiece's added prefix space;
//  - the whole text: Strip after Fuse (Llama 2 / Mistral: one leading space).
// A chain whose other steps would need the whole text (Replace after Fuse, Strip of trailing
// characters after Fuse...) is refused at load with the step named, so decode() and the stream
// decoder can never disagree.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/json_util.h"
#include "tokenizer/pretokenizer_regex.h"

namespace moelora {

class Normalizer;

class TokenDecoder {
 public:
  // `config` is the "decoder" value of tokenizer.json (an object; null is refused: Rust would
  // join the tokens with spaces, which no served model wants).
  static Result<TokenDecoder> from_json(const Json& config, TokenizerCompat compat, std::string_view what);

  TokenDecoder();
  ~TokenDecoder();
  TokenDecoder(TokenDecoder&&) noexcept;
  TokenDecoder& operator=(TokenDecoder&&) noexcept;

  // The bytes a vocabulary token contributes; `first` when it is the first token of the text.
  // A "<0xXX>" token under ByteFallback is that single byte (possibly part of a character).
  std::string token_bytes(std::string_view token, bool first) const;
  // Whether token_bytes(t, true) can differ from token_bytes(t, false).
  bool has_first_token_rule() const { return metaspace_first_ != MetaspaceFirst::kNone; }

  // Characters to strip from the start of the whole text (Strip after Fuse): up to
  // lead_strip_count() copies of lead_strip_char().
  int lead_strip_count() const { return lead_strip_count_; }
  char32_t lead_strip_char() const { return lead_strip_char_; }

 private:
  struct Step;
  enum class MetaspaceFirst { kNone, kDropAll, kDropOneSpace };

  std::vector<Step> steps_;  // per-token steps, in chain order
  MetaspaceFirst metaspace_first_ = MetaspaceFirst::kNone;
  int lead_strip_count_ = 0;
  char32_t lead_strip_char_ = U' ';
};

// Removes up to `*budget` leading `c` characters of `text` (valid UTF-8), decrementing the
// budget; any other character (or the end of a non-empty text) sets the budget to 0, so the
// rule only ever touches the very start of a stream.
void strip_leading(std::string& text, char32_t c, int* budget);

}  // namespace moelora
