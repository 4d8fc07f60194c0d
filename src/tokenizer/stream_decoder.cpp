#include "tokenizer/stream_decoder.h"

#include "tokenizer/utf8.h"

namespace moelora {

StreamDecoder::StreamDecoder(std::shared_ptr<const BpeTokenizer> tokenizer, bool skip_special_tokens,
                             bool continues_text)
    : tokenizer_(std::move(tokenizer)), skip_special_tokens_(skip_special_tokens), first_(!continues_text) {
  if (!continues_text) lead_budget_ = tokenizer_->token_decoder().lead_strip_count();
}

std::string StreamDecoder::push(int32_t id) {
  const BpeTokenizer::Piece p = tokenizer_->piece(id);
  switch (p.kind) {
    case BpeTokenizer::Piece::kNone:
      return {};
    case BpeTokenizer::Piece::kAddedToken: {
      if (skip_special_tokens_ && p.special) return {};
      // An added token ends any pending character, as in decode().
      std::string out = finish();
      out.append(p.text);
      first_ = false;
      strip_leading(out, tokenizer_->token_decoder().lead_strip_char(), &lead_budget_);
      return out;
    }
    case BpeTokenizer::Piece::kBytes:
      break;
  }
  if (first_) {
    pending_ += tokenizer_->first_piece_bytes(id);
    first_ = false;
  } else {
    pending_.append(p.text);
  }
  // Everything but an unfinished character at the end is final: ill-formed bytes cannot be
  // repaired by later ones, so they become U+FFFD now, exactly as decode() would replace them.
  const size_t hold = utf8::incomplete_tail_length(pending_);
  const std::string_view ready = std::string_view(pending_).substr(0, pending_.size() - hold);
  std::string out = utf8::is_valid(ready) ? std::string(ready) : utf8::sanitize(ready);
  pending_.erase(0, pending_.size() - hold);
  strip_leading(out, tokenizer_->token_decoder().lead_strip_char(), &lead_budget_);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  strip_leading(out, tokenizer_->token_decoder().lead_strip_char(), &lead_budget_);
  return out;
}

}  // namespace moelora
