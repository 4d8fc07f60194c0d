#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace moelora::byte_level {
namespace {

bool stands_for_itself(int byte) {
  return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE && byte <= 0xFF);
}

struct Tables {
  std::array<char32_t, 256> byte_to_char{};
  std::array<std::string, 256> byte_to_utf8{};
  std::array<uint8_t, 256> symbol_order{};
  std::array<int16_t, 0x100 + 68> char_to_byte{};  // -1: not a symbol
  Tables() {
    char_to_byte.fill(-1);
    int next_remapped = 0;
    int order = 0;
    for (int b = 0; b < 256; ++b) {
      if (stands_for_itself(b)) symbol_order[order++] = static_cast<uint8_t>(b);
    }
    for (int b = 0; b < 256; ++b) {
      if (stands_for_itself(b)) {
        byte_to_char[b] = static_cast<char32_t>(b);
      } else {
        byte_to_char[b] = static_cast<char32_t>(0x100 + next_remapped++);
        symbol_order[order++] = static_cast<uint8_t>(b);
      }
      utf8::append(byte_to_utf8[b], byte_to_char[b]);
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t byte_to_char(uint8_t byte) { return tables().byte_to_char[byte]; }

std::optional<uint8_t> char_to_byte(char32_t cp) {
  const Tables& t = tables();
  if (cp >= t.char_to_byte.size() || t.char_to_byte[cp] < 0) return std::nullopt;
  return static_cast<uint8_t>(t.char_to_byte[cp]);
}

const std::array<uint8_t, 256>& bytes_in_symbol_order() { return tables().symbol_order; }

void encode(std::string_view bytes, std::string& out) {
  const Tables& t = tables();
  for (char c : bytes) out += t.byte_to_utf8[static_cast<uint8_t>(c)];
}

bool decode(std::string_view token, std::string& out) {
  const size_t mark = out.size();
  size_t pos = 0;
  while (pos < token.size()) {
    const utf8::Sequence s = utf8::next_sequence(token, pos);
    std::optional<uint8_t> byte;
    if (s.kind == utf8::SequenceKind::kValid) byte = char_to_byte(s.code_point);
    if (!byte) {
      out.resize(mark);
      return false;
    }
    out.push_back(static_cast<char>(*byte));
    pos += s.length;
  }
  return true;
}

}  // namespace moelora::byte_level
