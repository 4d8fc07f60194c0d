#include "tokenizer/unicode.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "tokenizer/utf8.h"

namespace moelora::unicode {
namespace {

struct CodePointRange {
  char32_t first, last;
};
struct CombiningClassRange {
  char32_t first, last;
  uint8_t ccc;
};
struct Decomposition {
  char32_t cp, first, second;  // second == 0: a singleton decomposition
};
struct Composition {
  char32_t first, second, composite;
};
struct CaseMapping {
  char32_t cp, to[3];
};

#include "tokenizer/unicode_tables_nfc.inc"
#include "tokenizer/unicode_tables_case.inc"

template <typename Range, size_t N>
const Range* find_range(const Range (&table)[N], char32_t cp) {
  const Range* it = std::upper_bound(std::begin(table), std::end(table), cp,
                                     [](char32_t c, const Range& r) { return c < r.first; });
  if (it == std::begin(table)) return nullptr;
  --it;
  return cp <= it->last ? it : nullptr;
}

template <size_t N>
int map_case(const CaseMapping (&table)[N], char32_t cp, char32_t out[3]) {
  const CaseMapping* it = std::lower_bound(std::begin(table), std::end(table), cp,
                                           [](const CaseMapping& m, char32_t c) { return m.cp < c; });
  if (it == std::end(table) || it->cp != cp) {
    out[0] = cp;
    return 1;
  }
  int n = 0;
  for (char32_t c : it->to) {
    if (c == 0) break;
    out[n++] = c;
  }
  return n;
}

// Hangul syllables compose and decompose by arithmetic (Unicode §3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr char32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

const Decomposition* find_decomposition(char32_t cp) {
  const auto* it = std::lower_bound(std::begin(kCanonicalDecompositions), std::end(kCanonicalDecompositions), cp,
                                    [](const Decomposition& d, char32_t c) { return d.cp < c; });
  return it != std::end(kCanonicalDecompositions) && it->cp == cp ? it : nullptr;
}

void decompose_into(char32_t cp, std::u32string& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const Decomposition* d = find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose_into(d->first, out);
  if (d->second != 0) decompose_into(d->second, out);
}

// Canonical ordering: a stable sort by combining class of each run of non-starters.
void reorder(std::u32string& cps) {
  size_t i = 0;
  while (i < cps.size()) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
}

char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* it = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{a, b},
                                    [](const Composition& c, const std::pair<char32_t, char32_t>& key) {
                                      return std::pair{c.first, c.second} < key;
                                    });
  if (it != std::end(kCompositions) && it->first == a && it->second == b) return it->composite;
  return 0;
}

// Canonical composition (Unicode §3.11, D117): each character joins the last starter unless a
// character in between blocks it (same or higher combining class, or a starter).
void compose(std::u32string& cps) {
  if (cps.empty()) return;
  size_t starter = 0;
  bool have_starter = combining_class(cps[0]) == 0;
  size_t out = 1;
  int last_ccc = have_starter ? 0 : 256;
  for (size_t i = 1; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    const int ccc = combining_class(c);
    const bool blocked = !have_starter || (last_ccc != 0 && last_ccc >= ccc) ||
                         (last_ccc == 0 && out != starter + 1);
    if (!blocked) {
      if (char32_t composite = compose_pair(cps[starter], c)) {
        cps[starter] = composite;
        continue;
      }
    }
    if (ccc == 0) {
      starter = out;
      have_starter = true;
    }
    last_ccc = ccc;
    cps[out++] = c;
  }
  cps.resize(out);
}

bool may_change_under_nfc(char32_t cp) {
  return cp >= 0x300 && find_range(kNfcMayChangeRanges, cp) != nullptr;
}

}  // namespace

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const CombiningClassRange* r = find_range(kCombiningClassRanges, cp);
  return r ? r->ccc : 0;
}

std::string nfc(std::string_view text) {
  // Nearly all text is already in NFC: only normalize when a character that could change is
  // present.
  bool needed = false;
  for (size_t pos = 0; pos < text.size() && !needed;) {
    if (static_cast<uint8_t>(text[pos]) < 0xCC) {  // every code point below U+0300
      pos += (static_cast<uint8_t>(text[pos]) < 0x80) ? 1 : 2;
      continue;
    }
    needed = may_change_under_nfc(utf8::decode_valid(text, pos));
  }
  if (!needed) return std::string(text);
  std::u32string cps;
  cps.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) decompose_into(utf8::decode_valid(text, pos), cps);
  reorder(cps);
  compose(cps);
  return utf8::from_code_points(cps);
}

std::string nfd(std::string_view text) {
  std::u32string cps;
  cps.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) decompose_into(utf8::decode_valid(text, pos), cps);
  reorder(cps);
  return utf8::from_code_points(cps);
}

bool is_white_space(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_ecmascript_space(char32_t cp) {
  if (cp == 0x85) return false;
  return cp == 0xFEFF || is_white_space(cp);
}

bool is_python_space(char32_t cp) { return (cp >= 0x1C && cp <= 0x1F) || is_white_space(cp); }

bool is_cased(char32_t cp) { return find_range(kCasedRanges, cp) != nullptr; }

bool is_printable(char32_t cp) { return find_range(kNonPrintableRanges, cp) == nullptr; }

int to_upper(char32_t cp, char32_t out[3]) { return map_case(kUpperMappings, cp, out); }
int to_lower(char32_t cp, char32_t out[3]) { return map_case(kLowerMappings, cp, out); }
int to_title(char32_t cp, char32_t out[3]) {
  const CaseMapping* it = std::lower_bound(std::begin(kTitleMappings), std::end(kTitleMappings), cp,
                                           [](const CaseMapping& m, char32_t c) { return m.cp < c; });
  if (it != std::end(kTitleMappings) && it->cp == cp) return map_case(kTitleMappings, cp, out);
  return to_upper(cp, out);
}

}  // namespace moelora::unicode
