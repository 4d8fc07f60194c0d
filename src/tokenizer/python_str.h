// Python str operations on UTF-8 text, with Python's rules: indices count code points, strip()
// and split() use str.isspace(), upper()/lower() use full case mappings ("ß".upper() == "SS").
// Chat templates call these as methods (message.content.split('</think>')[-1].lstrip('\n')).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moelora::pystr {

size_t length(std::string_view s);  // in code points
// Byte offset of code point `index` (0 <= index <= length).
size_t byte_offset(std::string_view s, size_t index);

enum class StripSide { kBoth, kLeft, kRight };
// Without `chars`, strips str.isspace() characters; with it, any of its characters.
std::string strip(std::string_view s, const std::optional<std::string>& chars, StripSide side);

// split(): on runs of white space, dropping empty parts; split(sep): on each occurrence of sep.
// maxsplit < 0: no limit. rsplit counts from the right.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> splitlines(std::string_view s, bool keepends);

std::string upper(std::string_view s);
std::string lower(std::string_view s);
std::string title(std::string_view s);       // str.title()
std::string capitalize(std::string_view s);  // str.capitalize()
std::string swapcase(std::string_view s);

std::string replace(std::string_view s, std::string_view old, std::string_view replacement, int64_t count);
// Code point index of the first (last) occurrence, or -1.
int64_t find(std::string_view s, std::string_view sub);
int64_t rfind(std::string_view s, std::string_view sub);
int64_t count(std::string_view s, std::string_view sub);
std::string center(std::string_view s, int64_t width, std::string_view fill);

bool is_lower(std::string_view s);  // str.islower()
bool is_upper(std::string_view s);  // str.isupper()
bool is_space(std::string_view s);  // str.isspace()

}  // namespace moelora::pystr
