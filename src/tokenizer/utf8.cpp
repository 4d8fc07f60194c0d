#include "tokenizer/utf8.h"

namespace moelora::utf8 {

void append(std::string& out, char32_t cp) {
  if (cp >= 0xD800 && cp <= 0xDFFF) cp = kReplacementChar;
  if (cp > 0x10FFFF) cp = kReplacementChar;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

Sequence next_sequence(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte(pos);
  if (lead < 0x80) return {SequenceKind::kValid, lead, 1};

  // Table 3-7 of the Unicode standard: the lead byte fixes the length and the range allowed
  // for the second byte (which rules out overlongs, surrogates and values past U+10FFFF).
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;
  char32_t cp;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1;
    cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2;
    cp = lead & 0x0F;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3;
    cp = lead & 0x07;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return {SequenceKind::kInvalid, kReplacementChar, 1};
  }
  size_t i = 1;
  for (; i <= need; ++i) {
    if (pos + i >= text.size()) return {SequenceKind::kIncomplete, kReplacementChar, i};
    const uint8_t b = byte(pos + i);
    const uint8_t min = i == 1 ? lo : 0x80;
    const uint8_t max = i == 1 ? hi : 0xBF;
    if (b < min || b > max) return {SequenceKind::kInvalid, kReplacementChar, i};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {SequenceKind::kValid, cp, need + 1};
}

bool is_valid(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Sequence s = next_sequence(text, pos);
    if (s.kind != SequenceKind::kValid) return false;
    pos += s.length;
  }
  return true;
}

std::string sanitize(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  size_t pos = 0;
  while (pos < text.size()) {
    const Sequence s = next_sequence(text, pos);
    if (s.kind == SequenceKind::kValid) {
      out.append(text.substr(pos, s.length));
    } else {
      append(out, kReplacementChar);
    }
    pos += s.length;
  }
  return out;
}

char32_t decode_valid(std::string_view text, size_t& pos) {
  const uint8_t lead = static_cast<uint8_t>(text[pos]);
  if (lead < 0x80) {
    ++pos;
    return lead;
  }
  const Sequence s = next_sequence(text, pos);
  pos += s.length;
  return s.code_point;
}

std::u32string to_code_points(std::string_view valid_text) {
  std::u32string out;
  out.reserve(valid_text.size());
  size_t pos = 0;
  while (pos < valid_text.size()) out.push_back(decode_valid(valid_text, pos));
  return out;
}

std::string from_code_points(std::u32string_view code_points) {
  std::string out;
  out.reserve(code_points.size());
  for (char32_t cp : code_points) append(out, cp);
  return out;
}

size_t incomplete_tail_length(std::string_view text) {
  // A sequence is at most 4 bytes, so only a lead byte among the last 3 can start an
  // unfinished one.
  const size_t n = text.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const uint8_t b = static_cast<uint8_t>(text[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // a continuation byte: keep looking for the lead
    if (b < 0x80) return 0;
    const Sequence s = next_sequence(text, n - back);
    return s.kind == SequenceKind::kIncomplete && s.length == back ? back : 0;
  }
  return 0;
}

}  // namespace moelora::utf8
