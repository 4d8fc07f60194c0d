#include "tokenizer/jinja_lexer.h"

#include <algorithm>

#include <fmt/format.h>

#include "tokenizer/jinja_value.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora::jinja {

bool is_python_space_at(std::string_view text, size_t pos, size_t* length) {
  const uint8_t b = static_cast<uint8_t>(text[pos]);
  if (b < 0x80) {
    *length = 1;
    return unicode::is_python_space(b);
  }
  const utf8::Sequence s = utf8::next_sequence(text, pos);
  *length = s.length;
  return s.kind == utf8::SequenceKind::kValid && unicode::is_python_space(s.code_point);
}

namespace {

[[noreturn]] void fail_at(int line, std::string message) { throw Error{std::move(message), line}; }

// Jinja2 treats \r\n, \r and \n as line breaks and writes them as \n; without
// keep_trailing_newline one final line break is dropped.
std::string normalize_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

size_t skip_space(std::string_view s, size_t pos) {
  size_t n;
  while (pos < s.size() && is_python_space_at(s, pos, &n)) pos += n;
  return pos;
}

std::string rstrip_space(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t begin = end - 1;
    while (begin > 0 && (static_cast<uint8_t>(s[begin]) & 0xC0) == 0x80) --begin;
    size_t n;
    if (!is_python_space_at(s, begin, &n)) break;
    end = begin;
  }
  return std::string(s.substr(0, end));
}

bool all_space(std::string_view s) {
  if (s.empty()) return false;  // Jinja2 uses \s+, which needs one character
  return skip_space(s, 0) == s.size();
}

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Python's "unicode-escape" decoding of a string literal's body.
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case '\n': break;  // a backslash before a line break joins the lines
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x': case 'u': case 'U': {
        const size_t digits = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
        char32_t cp = 0;
        for (size_t k = 0; k < digits; ++k) {
          const int h = i + 1 + k < body.size() ? hex_value(body[i + 1 + k]) : -1;
          if (h < 0) fail_at(line, fmt::format("truncated \\{} escape in a string", e));
          cp = cp * 16 + static_cast<char32_t>(h);
        }
        i += digits;
        utf8::append(out, cp);  // a surrogate or out-of-range value becomes U+FFFD
        break;
      }
      case 'N':
        fail_at(line, "\\N{...} escapes in strings are not supported");
      default:
        if (e >= '0' && e <= '7') {
          char32_t cp = static_cast<char32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            cp = cp * 8 + static_cast<char32_t>(body[++i] - '0');
          }
          utf8::append(out, cp);
        } else {
          out += '\\';  // unknown escapes stay as written
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_source(source)) {
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') newlines_.push_back(i);
    }
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      const size_t tag = find_tag(pos);
      if (tag == std::string::npos) {
        emit_data(src_.substr(pos), pos);
        break;
      }
      const char kind = src_[tag + 1];
      const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      size_t raw_end = 0;
      const bool raw = kind == '%' && is_raw_begin(tag, &raw_end);
      emit_data(strip_before_tag(std::string_view(src_).substr(pos, tag - pos), sign, kind != '{', line_starting), pos);
      if (raw) {
        pos = lex_raw(raw_end, &line_starting);
      } else if (kind == '#') {
        pos = lex_comment(tag + (sign ? 3 : 2), &line_starting);
      } else {
        pos = lex_tag(tag, kind, sign ? 3 : 2, &line_starting);
      }
    }
    tokens_.push_back({TokenType::kEof, "", line_at(src_.size())});
    return std::move(tokens_);
  }

 private:
  int line_at(size_t pos) const {
    return 1 + static_cast<int>(std::lower_bound(newlines_.begin(), newlines_.end(), pos) - newlines_.begin());
  }

  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  void emit_data(std::string text, size_t pos) {
    if (!text.empty()) tokens_.push_back({TokenType::kData, std::move(text), line_at(pos)});
  }
  void emit_data(std::string_view text, size_t pos) { emit_data(std::string(text), pos); }

  // `{%-` strips all whitespace before the tag; otherwise (lstrip_blocks) a block or comment
  // tag alone on its line after indentation takes the indentation away, unless `{%+`.
  std::string strip_before_tag(std::string_view text, char sign, bool lstrip_applies, bool line_starting) const {
    if (sign == '-') return rstrip_space(text);
    if (sign != '+' && lstrip_applies) {
      const size_t newline = text.rfind('\n');
      const size_t line_start = newline == std::string_view::npos ? 0 : newline + 1;
      if ((line_start > 0 || line_starting) && all_space(text.substr(line_start))) {
        return std::string(text.substr(0, line_start));
      }
    }
    return std::string(text);
  }

  // {%(-|+|)\s*raw\s*(-%}\s*|%})
  bool is_raw_begin(size_t tag, size_t* end) const {
    size_t p = tag + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    p = skip_space(src_, p);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p = skip_space(src_, p + 3);
    if (src_.compare(p, 3, "-%}") == 0) {
      *end = skip_space(src_, p + 3);
      return true;
    }
    if (src_.compare(p, 2, "%}") == 0) {
      *end = p + 2;
      return true;
    }
    return false;
  }

  // Consumes the end of a tag at `pos` if there is one: `+%}`, `-%}` plus whitespace, or `%}`
  // plus one line break (trim_blocks); `close` is "%}", "#}" or "}}" (no trim for variables).
  bool match_end(size_t pos, std::string_view close, bool trim_newline, size_t* end) const {
    if (src_.compare(pos, 1, "+") == 0 && src_.compare(pos + 1, close.size(), close) == 0 && close != "}}") {
      *end = pos + 1 + close.size();
      return true;
    }
    if (src_.compare(pos, 1, "-") == 0 && src_.compare(pos + 1, close.size(), close) == 0) {
      *end = skip_space(src_, pos + 1 + close.size());
      return true;
    }
    if (src_.compare(pos, close.size(), close) == 0) {
      *end = pos + close.size();
      if (trim_newline && *end < src_.size() && src_[*end] == '\n') ++*end;
      return true;
    }
    return false;
  }

  size_t lex_comment(size_t body, bool* line_starting) {
    for (size_t p = body; p < src_.size(); ++p) {
      size_t end;
      if ((src_[p] == '-' || src_[p] == '+' || src_[p] == '#') && match_end(p, "#}", true, &end)) {
        *line_starting = src_[end - 1] == '\n';
        return end;
      }
    }
    fail_at(line_at(body), "missing end of comment tag");
  }

  size_t lex_raw(size_t body, bool* line_starting) {
    *line_starting = body > 0 && src_[body - 1] == '\n';
    for (size_t p = src_.find("{%", body); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      const char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (sign) ++q;
      q = skip_space(src_, q);
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q = skip_space(src_, q + 6);
      size_t end;
      if (!match_end(q, "%}", true, &end)) continue;
      emit_data(strip_before_tag(std::string_view(src_).substr(body, p - body), sign, true, *line_starting), body);
      *line_starting = src_[end - 1] == '\n';
      return end;
    }
    fail_at(line_at(body), "missing end of raw directive");
  }

  size_t lex_tag(size_t tag, char kind, size_t opener_length, bool* line_starting) {
    const bool block = kind == '%';
    tokens_.push_back({block ? TokenType::kBlockBegin : TokenType::kVariableBegin, block ? "{%" : "{{", line_at(tag)});
    std::string balance;  // closing brackets expected, innermost last
    size_t pos = tag + opener_length;
    while (true) {
      if (pos >= src_.size()) {
        fail_at(line_at(tag), block ? "unexpected end of template: unclosed block tag '{%'"
                                    : "unexpected end of template: unclosed variable tag '{{'");
      }
      size_t end;
      if (balance.empty() && match_end(pos, block ? "%}" : "}}", block, &end)) {
        tokens_.push_back({block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", line_at(pos)});
        *line_starting = src_[end - 1] == '\n';
        return end;
      }
      size_t n;
      if (is_python_space_at(src_, pos, &n)) {
        pos += n;
        continue;
      }
      pos = lex_expression_token(pos, balance);
    }
  }

  size_t lex_expression_token(size_t pos, std::string& balance) {
    const int line = line_at(pos);
    const char c = src_[pos];
    if (is_digit(c)) return lex_number(pos);
    if (is_name_start(c)) {
      size_t end = pos;
      while (end < src_.size() && is_name_char(src_[end])) ++end;
      tokens_.push_back({TokenType::kName, src_.substr(pos, end - pos), line});
      return end;
    }
    if (c == '\'' || c == '"') {
      size_t p = pos + 1;
      while (p < src_.size() && src_[p] != c) p += src_[p] == '\\' ? 2 : 1;
      if (p >= src_.size()) fail_at(line, "unterminated string literal");
      tokens_.push_back({TokenType::kString, unescape(std::string_view(src_).substr(pos + 1, p - pos - 1), line), line});
      return p + 1;
    }
    static constexpr std::string_view kTwoChar[] = {"**", "//", "==", "!=", ">=", "<="};
    for (std::string_view op : kTwoChar) {
      if (src_.compare(pos, 2, op) == 0) {
        tokens_.push_back({TokenType::kOperator, std::string(op), line});
        return pos + 2;
      }
    }
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) {
      if (c == '(' || c == '[' || c == '{') balance += c == '(' ? ')' : (c == '[' ? ']' : '}');
      if (c == ')' || c == ']' || c == '}') {
        if (balance.empty()) fail_at(line, fmt::format("unexpected '{}'", c));
        if (balance.back() != c) fail_at(line, fmt::format("unexpected '{}', expected '{}'", c, balance.back()));
        balance.pop_back();
      }
      tokens_.push_back({TokenType::kOperator, std::string(1, c), line});
      return pos + 1;
    }
    size_t p = pos;
    const char32_t cp = static_cast<uint8_t>(c) < 0x80 ? static_cast<char32_t>(c) : utf8::decode_valid(src_, p);
    fail_at(line, fmt::format("unexpected character U+{:04X} in a tag (non-ASCII names are not supported)",
                              static_cast<uint32_t>(cp)));
  }

  // Integers (decimal, 0b, 0o, 0x, with _ separators) and floats (a fraction and/or exponent).
  size_t lex_number(size_t pos) {
    const int line = line_at(pos);
    const auto digits_from = [&](size_t p, auto is_ok) {
      while (p < src_.size() && (is_ok(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_ok(src_[p + 1])))) ++p;
      return p;
    };
    const auto dec = [](char ch) { return is_digit(ch); };
    if (src_[pos] == '0' && pos + 1 < src_.size() && std::string_view("bBoOxX").find(src_[pos + 1]) != std::string::npos) {
      const char base_char = static_cast<char>(src_[pos + 1] | 0x20);
      const int base = base_char == 'b' ? 2 : (base_char == 'o' ? 8 : 16);
      const auto ok = [base](char ch) {
        const int v = hex_value(ch);
        return v >= 0 && v < base;
      };
      size_t p = pos + 2;
      if (p < src_.size() && src_[p] == '_') ++p;
      const size_t end = digits_from(p, ok);
      if (end > p) {
        int64_t value = 0;
        for (size_t i = p; i < end; ++i) {
          if (src_[i] != '_') value = value * base + hex_value(src_[i]);
        }
        tokens_.push_back({TokenType::kInteger, src_.substr(pos, end - pos), line, value});
        return end;
      }
    }
    size_t end = digits_from(pos, dec);
    bool is_float = false;
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';  // (?<!\.) in Jinja2's float rule
    if (!after_dot && end + 1 < src_.size() && src_[end] == '.' && is_digit(src_[end + 1])) {
      end = digits_from(end + 1, dec);
      is_float = true;
    }
    if (!after_dot && end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t p = end + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && is_digit(src_[p])) {
        end = digits_from(p, dec);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos; i < end; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Token t{is_float ? TokenType::kFloat : TokenType::kInteger, src_.substr(pos, end - pos), line};
    if (is_float) {
      t.float_value = std::stod(text);
    } else {
      if (text.size() > 18) fail_at(line, fmt::format("integer literal {} is too large", text));
      t.int_value = std::stoll(text);
    }
    tokens_.push_back(std::move(t));
    return end;
  }

  std::string src_;
  std::vector<size_t> newlines_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) { return Lexer(source).run(); }

}  // namespace moelora::jinja
