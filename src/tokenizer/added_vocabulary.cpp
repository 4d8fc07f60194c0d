#include "tokenizer/added_vocabulary.h"

#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

// The code point that ends at byte `end` (exclusive) of valid UTF-8.
char32_t code_point_before(std::string_view text, size_t end) {
  size_t begin = end - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  return utf8::decode_valid(text, begin);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens,
                                     const std::vector<std::string>& normalized_contents,
                                     bool match_normalized_tokens, TokenizerCompat compat)
    : compat_(compat) {
  const bool js = compat == TokenizerCompat::kTransformersJs;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const AddedToken& token = tokens[i];
    // Rust matches non-normalized tokens in the raw text and normalized ones in the normalized
    // text (two matchers); transformers.js matches all of them in the raw text.
    if (!js && token.normalized != match_normalized_tokens) continue;
    if (js && match_normalized_tokens) continue;
    const std::string& key = !js && token.normalized ? normalized_contents[i] : token.content;
    if (key.empty()) continue;
    int32_t node = 0;
    for (char c : key) {
      const uint8_t byte = static_cast<uint8_t>(c);
      int32_t child = -1;
      for (const auto& [b, index] : nodes_[node].children) {
        if (b == byte) child = index;
      }
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(byte, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    // A later token with the same content replaces the earlier one (same as a map insert).
    nodes_[node].token = static_cast<int32_t>(tokens_.size());
    tokens_.push_back(token);
    first_bytes_[static_cast<uint8_t>(key[0])] = true;
    if (token.single_word && !js && !word_char_) {
      // Rust's regex \w: letters, marks, decimal digits, connector punctuation.
      auto re = PretokenizerRegex::compile(R"([\p{L}\p{M}\p{Nd}\p{Pc}])", compat, "single_word");
      if (re.ok()) word_char_ = *re;
    }
  }
}

AddedTokenMatcher::Match AddedTokenMatcher::longest_match_at(std::string_view text, size_t pos) const {
  int32_t node = 0;
  Match found;
  for (size_t i = pos; i < text.size(); ++i) {
    const uint8_t byte = static_cast<uint8_t>(text[i]);
    int32_t child = -1;
    for (const auto& [b, index] : nodes_[node].children) {
      if (b == byte) {
        child = index;
        break;
      }
    }
    if (child < 0) break;
    node = child;
    if (nodes_[node].token >= 0) found = {nodes_[node].token, i + 1};
  }
  return found;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& segments) const {
  const bool js = compat_ == TokenizerCompat::kTransformersJs;
  const auto is_space = [js](char32_t cp) {
    return js ? unicode::is_ecmascript_space(cp) : unicode::is_white_space(cp);
  };
  const auto is_word_char = [&](char32_t cp) {
    std::string s;
    utf8::append(s, cp);
    std::vector<std::pair<size_t, size_t>> m;
    word_char_->find_all(s, m);
    return !m.empty();
  };
  size_t start_offset = 0;  // end of the previous added-token segment
  size_t pos = 0;
  while (pos < text.size()) {
    if (!first_bytes_[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    const Match match = longest_match_at(text, pos);
    if (match.token < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[match.token];
    size_t begin = pos;
    size_t end = match.end;
    if (token.single_word && !js && word_char_) {
      // Only between non-word characters (or the ends of the text).
      size_t p = end;
      const bool word_before = begin > 0 && is_word_char(code_point_before(text, begin));
      const bool word_after = end < text.size() && is_word_char(utf8::decode_valid(text, p));
      if (word_before || word_after) {
        pos = end;  // Rust drops the match and resumes after it
        continue;
      }
    }
    if (token.lstrip) {
      while (begin > start_offset && is_space(code_point_before(text, begin))) {
        size_t b = begin - 1;
        while (b > 0 && (static_cast<uint8_t>(text[b]) & 0xC0) == 0x80) --b;
        begin = b;
      }
    }
    if (token.rstrip) {
      while (end < text.size()) {
        size_t p = end;
        if (!is_space(utf8::decode_valid(text, p))) break;
        end = p;
      }
    }
    if (begin > start_offset) segments.push_back({start_offset, begin, -1});
    segments.push_back({begin, end, token.id});
    start_offset = end;
    pos = end;
  }
  if (start_offset < text.size()) segments.push_back({start_offset, text.size(), -1});
}

}  // namespace moelora
