// GPT-2's byte-level alphabet: each of the 256 byte values is shown as a printable character
// so that BPE vocabularies never contain raw control bytes or spaces. Printable Latin-1 bytes
// stand for themselves; the other 68 bytes map, in byte order, to U+0100 upwards (0x20 -> 'Ġ',
// 0x0A -> 'Ċ'). The position of a byte in that order ("!" first, then the remapped bytes) is
// also the id of its symbol in GPT-2, Qwen and moelora's demo vocabulary.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moelora::byte_level {

// The character (a code point) that stands for a byte.
char32_t byte_to_char(uint8_t byte);
// The byte a character stands for, if it is one of the 256 symbols.
std::optional<uint8_t> char_to_byte(char32_t cp);

// The 256 bytes in GPT-2's symbol order (printable bytes first).
const std::array<uint8_t, 256>& bytes_in_symbol_order();

// Appends the symbols of each byte of `bytes`.
void encode(std::string_view bytes, std::string& out);
// Appends the bytes a token's symbols stand for; false (and nothing appended) if a character
// of the token is not a byte-level symbol.
bool decode(std::string_view token, std::string& out);

}  // namespace moelora::byte_level
