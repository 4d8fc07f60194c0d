// Splits a Jinja template into tokens the way Jinja2's lexer does with transformers' settings
// (trim_blocks, lstrip_blocks, keep_trailing_newline=False): template data with the whitespace
// control of `{%- -%}`, `{{- -}}`, `{#- -#}`, `{%+` already applied, comments and `{% raw %}`
// resolved, and the expression tokens inside tags.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moelora::jinja {

enum class TokenType {
  kData,           // template text to output as is
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,  // value: the unescaped text
  kInteger,
  kFloat,
  kOperator,  // value: + - * / // % ** ~ == != < <= > >= = . , : | ( ) [ ] { } ;
  kEof,
};

struct Token {
  TokenType type;
  std::string value;
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

// Throws jinja::Error (with the line) for text Jinja2 also rejects: an unclosed tag, comment or
// string, an unbalanced bracket, a character that starts no token.
std::vector<Token> tokenize(std::string_view source);

// Python's str.isspace(), which Jinja2's regexes use for the whitespace they strip.
bool is_python_space_at(std::string_view text, size_t pos, size_t* length);

}  // namespace moelora::jinja
