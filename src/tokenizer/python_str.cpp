#include "tokenizer/python_str.h"

#include <algorithm>

#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora::pystr {
namespace {

using Mapper = int (*)(char32_t, char32_t*);

std::string map_chars(std::string_view s, Mapper mapper) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  char32_t mapped[3];
  while (pos < s.size()) {
    const int n = mapper(utf8::decode_valid(s, pos), mapped);
    for (int i = 0; i < n; ++i) utf8::append(out, mapped[i]);
  }
  return out;
}

bool has_cased_neighbour(const std::u32string& cps, size_t i, int step) {
  for (int64_t j = static_cast<int64_t>(i) + step; j >= 0 && j < static_cast<int64_t>(cps.size()); j += step) {
    if (unicode::is_cased(cps[static_cast<size_t>(j)])) return true;
    // Python skips case-ignorable characters; apostrophes and combining marks are the usual ones.
    const char32_t c = cps[static_cast<size_t>(j)];
    if (!(c == '\'' || c == 0x2019 || unicode::combining_class(c) != 0)) return false;
  }
  return false;
}

// lower() of one character at position i, with Python's final-sigma rule.
void lower_at(const std::u32string& cps, size_t i, std::string& out) {
  if (cps[i] == 0x03A3) {
    const bool final_sigma = has_cased_neighbour(cps, i, -1) && !has_cased_neighbour(cps, i, +1);
    utf8::append(out, final_sigma ? 0x03C2 : 0x03C3);
    return;
  }
  char32_t mapped[3];
  const int n = unicode::to_lower(cps[i], mapped);
  for (int k = 0; k < n; ++k) utf8::append(out, mapped[k]);
}

bool is_space_cp(char32_t c) { return unicode::is_python_space(c); }

std::vector<std::string> split_whitespace(std::string_view s, int64_t maxsplit, bool from_right) {
  const std::u32string cps = utf8::to_code_points(s);
  std::vector<std::pair<size_t, size_t>> words;  // code point ranges
  size_t i = 0;
  while (i < cps.size()) {
    while (i < cps.size() && is_space_cp(cps[i])) ++i;
    if (i == cps.size()) break;
    size_t j = i;
    while (j < cps.size() && !is_space_cp(cps[j])) ++j;
    words.emplace_back(i, j);
    i = j;
  }
  std::vector<std::string> out;
  if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
    for (const auto& [b, e] : words) out.push_back(utf8::from_code_points(std::u32string_view(cps).substr(b, e - b)));
    return out;
  }
  const size_t keep = static_cast<size_t>(maxsplit);
  if (!from_right) {
    for (size_t k = 0; k < keep; ++k) {
      out.push_back(utf8::from_code_points(std::u32string_view(cps).substr(words[k].first, words[k].second - words[k].first)));
    }
    // The rest, from the next word, with trailing white space removed (as Python does).
    size_t end = cps.size();
    while (end > 0 && is_space_cp(cps[end - 1])) --end;
    out.push_back(utf8::from_code_points(std::u32string_view(cps).substr(words[keep].first, end - words[keep].first)));
  } else {
    size_t begin = 0;
    while (begin < cps.size() && is_space_cp(cps[begin])) ++begin;
    const size_t first_kept = words.size() - keep;
    out.push_back(utf8::from_code_points(std::u32string_view(cps).substr(begin, words[first_kept - 1].second - begin)));
    for (size_t k = first_kept; k < words.size(); ++k) {
      out.push_back(utf8::from_code_points(std::u32string_view(cps).substr(words[k].first, words[k].second - words[k].first)));
    }
  }
  return out;
}

}  // namespace

size_t length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

size_t byte_offset(std::string_view s, size_t index) {
  size_t pos = 0;
  for (size_t i = 0; i < index && pos < s.size(); ++i) utf8::decode_valid(s, pos);
  return pos;
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, StripSide side) {
  const std::u32string cps = utf8::to_code_points(s);
  const std::u32string set = chars ? utf8::to_code_points(*chars) : std::u32string();
  const auto strippable = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : is_space_cp(c); };
  size_t begin = 0, end = cps.size();
  if (side != StripSide::kRight) {
    while (begin < end && strippable(cps[begin])) ++begin;
  }
  if (side != StripSide::kLeft) {
    while (end > begin && strippable(cps[end - 1])) --end;
  }
  return utf8::from_code_points(std::u32string_view(cps).substr(begin, end - begin));
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  if (!sep) return split_whitespace(s, maxsplit, false);
  std::vector<std::string> out;
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    const size_t hit = s.find(*sep, pos);
    if (hit == std::string_view::npos) break;
    out.emplace_back(s.substr(pos, hit - pos));
    pos = hit + sep->size();
  }
  out.emplace_back(s.substr(pos));
  return out;
}

std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  if (!sep) return split_whitespace(s, maxsplit, true);
  if (maxsplit < 0) return split(s, sep, -1);
  std::vector<std::string> out;
  size_t end = s.size();
  while (static_cast<int64_t>(out.size()) < maxsplit) {
    if (end < sep->size()) break;
    const size_t hit = s.rfind(*sep, end - sep->size());
    if (hit == std::string_view::npos) break;
    out.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
    end = hit;
  }
  out.emplace_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> splitlines(std::string_view s, bool keepends) {
  // Python's line boundaries: \n \r \r\n \v \f \x1c \x1d \x1e \x85 \u2028 \u2029.
  std::vector<std::string> out;
  size_t line_start = 0, pos = 0;
  while (pos < s.size()) {
    const size_t here = pos;
    const char32_t c = utf8::decode_valid(s, pos);
    const bool boundary = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                          c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!boundary) continue;
    if (c == '\r' && pos < s.size() && s[pos] == '\n') ++pos;
    out.emplace_back(s.substr(line_start, (keepends ? pos : here) - line_start));
    line_start = pos;
  }
  if (line_start < s.size()) out.emplace_back(s.substr(line_start));
  return out;
}

std::string upper(std::string_view s) { return map_chars(s, &unicode::to_upper); }

std::string lower(std::string_view s) {
  const std::u32string cps = utf8::to_code_points(s);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < cps.size(); ++i) lower_at(cps, i, out);
  return out;
}

std::string title(std::string_view s) {
  const std::u32string cps = utf8::to_code_points(s);
  std::string out;
  bool previous_cased = false;
  char32_t mapped[3];
  for (size_t i = 0; i < cps.size(); ++i) {
    if (previous_cased) {
      lower_at(cps, i, out);
    } else {
      const int n = unicode::to_title(cps[i], mapped);
      for (int k = 0; k < n; ++k) utf8::append(out, mapped[k]);
    }
    previous_cased = unicode::is_cased(cps[i]);
  }
  return out;
}

std::string capitalize(std::string_view s) {
  const std::u32string cps = utf8::to_code_points(s);
  std::string out;
  char32_t mapped[3];
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      const int n = unicode::to_title(cps[0], mapped);
      for (int k = 0; k < n; ++k) utf8::append(out, mapped[k]);
    } else {
      lower_at(cps, i, out);
    }
  }
  return out;
}

std::string swapcase(std::string_view s) {
  const std::u32string cps = utf8::to_code_points(s);
  std::string out;
  char32_t mapped[3];
  for (char32_t c : cps) {
    char32_t probe[3];
    const bool is_up = unicode::to_lower(c, probe) != 1 || probe[0] != c;
    const int n = is_up ? unicode::to_lower(c, mapped) : unicode::to_upper(c, mapped);
    for (int k = 0; k < n; ++k) utf8::append(out, mapped[k]);
  }
  return out;
}

std::string replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement between every character and at both ends.
    int64_t done = 0;
    size_t pos = 0;
    while (pos <= s.size()) {
      if (count < 0 || done < count) {
        out.append(replacement);
        ++done;
      }
      if (pos == s.size()) break;
      const size_t begin = pos;
      utf8::decode_valid(s, pos);
      out.append(s.substr(begin, pos - begin));
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t hit = s.find(old, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(replacement);
    pos = hit + old.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

int64_t find(std::string_view s, std::string_view sub) {
  const size_t hit = s.find(sub);
  return hit == std::string_view::npos ? -1 : static_cast<int64_t>(length(s.substr(0, hit)));
}

int64_t rfind(std::string_view s, std::string_view sub) {
  const size_t hit = s.rfind(sub);
  return hit == std::string_view::npos ? -1 : static_cast<int64_t>(length(s.substr(0, hit)));
}

int64_t count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(length(s)) + 1;
  int64_t n = 0;
  for (size_t pos = s.find(sub); pos != std::string_view::npos; pos = s.find(sub, pos + sub.size())) ++n;
  return n;
}

std::string center(std::string_view s, int64_t width, std::string_view fill) {
  const auto len = static_cast<int64_t>(length(s));
  if (width <= len) return std::string(s);
  const int64_t pad = width - len;
  const int64_t left = pad / 2 + (pad & width & 1);  // CPython's rounding
  std::string out;
  for (int64_t i = 0; i < left; ++i) out.append(fill);
  out.append(s);
  for (int64_t i = 0; i < pad - left; ++i) out.append(fill);
  return out;
}

bool is_lower(std::string_view s) {
  bool cased = false;
  size_t pos = 0;
  char32_t mapped[3];
  while (pos < s.size()) {
    const char32_t c = utf8::decode_valid(s, pos);
    if (!unicode::is_cased(c)) continue;
    // A cased character that lower() would change is not lowercase.
    if (unicode::to_lower(c, mapped) != 1 || mapped[0] != c) return false;
    cased = true;
  }
  return cased;
}

bool is_upper(std::string_view s) {
  bool cased = false;
  size_t pos = 0;
  char32_t mapped[3];
  while (pos < s.size()) {
    const char32_t c = utf8::decode_valid(s, pos);
    if (!unicode::is_cased(c)) continue;
    if (unicode::to_upper(c, mapped) != 1 || mapped[0] != c) return false;
    cased = true;
  }
  return cased;
}

bool is_space(std::string_view s) {
  if (s.empty()) return false;
  size_t pos = 0;
  while (pos < s.size()) {
    if (!is_space_cp(utf8::decode_valid(s, pos))) return false;
  }
  return true;
}

}  // namespace moelora::pystr
