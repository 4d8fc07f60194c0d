// Incremental detokenization for streamed responses: push ids one at a time, get the text that
// is final so far. A UTF-8 character split across tokens (emoji, CJK under byte-level BPE) is
// held back until its last byte arrives, so no chunk ever ends in half a character; bytes that
// can no longer become valid UTF-8 come out as U+FFFD. The concatenation of all chunks plus
// finish() equals BpeTokenizer::decode of all the ids.
//
// A SentencePiece decoder treats the start of a text specially (the prefix space of the first
// token is dropped). A stream that continues a prompt (the server's completions) is not the
// start of a text: with `continues_text` those rules are off, so "The capital is" + "▁Paris"
// streams " Paris", as Rust's DecodeStream and vLLM do after a prompt; the chunks then equal
// decode(prompt + ids) minus decode(prompt).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tokenizer/bpe_tokenizer.h"

namespace moelora {

class StreamDecoder {
 public:
  StreamDecoder(std::shared_ptr<const BpeTokenizer> tokenizer, bool skip_special_tokens, bool continues_text = false);

  // Text completed by this token (possibly empty).
  std::string push(int32_t id);
  // End of the stream: what is still held back (an incomplete character becomes U+FFFD).
  std::string finish();
  // Bytes held back, waiting for the rest of a character.
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::shared_ptr<const BpeTokenizer> tokenizer_;
  bool skip_special_tokens_;
  bool first_ = true;     // no token kept yet: the decoder's first-token rule applies
  int lead_budget_ = 0;   // leading characters still to strip (Strip after Fuse)
  std::string pending_;  // the start of a character that is not complete yet (at most 3 bytes)
};

}  // namespace moelora
