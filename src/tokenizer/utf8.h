// UTF-8 helpers for the tokenizer. Text reaches the tokenizer as bytes (HTTP bodies, stdin,
// token pieces), so every entry point first makes it valid UTF-8: each ill-formed subsequence
// becomes one U+FFFD, using the "maximal subpart" rule of Unicode §3.9 / the WHATWG decoder.
// That is what JavaScript's TextDecoder, Python's bytes.decode(errors="replace") and Rust's
// String::from_utf8_lossy do, so a lone surrogate (ED A0 80), an overlong form or a truncated
// sequence turns into the same replacement characters in all of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moelora::utf8 {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Appends the UTF-8 encoding of a Unicode scalar value (a surrogate or value past U+10FFFF is
// written as U+FFFD).
void append(std::string& out, char32_t cp);

enum class SequenceKind {
  kValid,       // a complete, well-formed code point
  kInvalid,     // an ill-formed subsequence (its maximal subpart)
  kIncomplete,  // a well-formed prefix cut off by the end of the input
};

struct Sequence {
  SequenceKind kind;
  char32_t code_point;  // U+FFFD unless kValid
  size_t length;        // bytes consumed: >= 1 whenever pos < text.size()
};

// Examines the sequence that starts at text[pos] (pos < text.size()).
Sequence next_sequence(std::string_view text, size_t pos);

// True if the whole text is well-formed UTF-8.
bool is_valid(std::string_view text);

// The text with each ill-formed subsequence (and a truncated tail) replaced by U+FFFD.
std::string sanitize(std::string_view text);

// Decodes one code point of *valid* UTF-8 at text[pos] and advances pos.
char32_t decode_valid(std::string_view text, size_t& pos);

// Whole-string conversions; the input of to_code_points must be valid UTF-8.
std::u32string to_code_points(std::string_view valid_text);
std::string from_code_points(std::u32string_view code_points);

// Length of a trailing run that is the start of a well-formed sequence not yet complete (0-3):
// a stream decoder holds exactly these bytes back until more arrive.
size_t incomplete_tail_length(std::string_view text);

}  // namespace moelora::utf8
