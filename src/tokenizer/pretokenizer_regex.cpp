#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenizer_regex.h"

#include <pcre2.h>

#include <atomic>

#include "core/log.h"

namespace moelora {
namespace {

// Class items (usable inside [...]) for each library's white space, see TokenizerCompat.
constexpr std::string_view kOnigurumaSpaceItems =
    R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
constexpr std::string_view kEcmaScriptSpaceItems =
    R"(\t\n\x0B\f\r\x20\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF})";
// Oniguruma's Unicode \w is Letter | Mark | Decimal_Number | Connector_Punctuation; PCRE2 10.42's
// is L | N | underscore. JavaScript's is ASCII only, as is its \d.
constexpr std::string_view kOnigurumaWordItems = R"(\p{L}\p{M}\p{Nd}\p{Pc})";
constexpr std::string_view kEcmaScriptWordItems = "A-Za-z0-9_";
constexpr std::string_view kOnigurumaDigitItems = R"(\p{Nd})";
constexpr std::string_view kEcmaScriptDigitItems = "0-9";
// In Oniguruma's Ruby syntax \h is a hex digit (in PCRE2 it is horizontal space).
constexpr std::string_view kHexDigitItems = "0-9a-fA-F";

// transformers.js cannot compile inline (?i:...) groups, so it swaps this exact group (the
// contractions of the GPT-4 / Qwen / Llama 3 patterns) for an ASCII-only spelling.
constexpr std::string_view kContractionsCaseless = "(?i:'s|'t|'re|'ve|'m|'ll|'d)";
constexpr std::string_view kContractionsAscii = "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))";

std::string replace_all(std::string text, std::string_view from, std::string_view to) {
  size_t pos = 0;
  while ((pos = text.find(from, pos)) != std::string::npos) {
    text.replace(pos, from.size(), to);
    pos += to.size();
  }
  return text;
}

std::atomic<bool> g_warned_match_error{false};

}  // namespace

Result<std::string> translate_pattern(std::string_view pattern_in, TokenizerCompat compat) {
  const bool js = compat == TokenizerCompat::kTransformersJs;
  std::string pattern(pattern_in);
  if (js) pattern = replace_all(pattern, kContractionsCaseless, kContractionsAscii);

  std::string out;
  out.reserve(pattern.size() * 2);
  bool in_class = false;
  size_t class_body_start = 0;  // where the items of the current class begin (after [ or [^)
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      std::string_view items;
      bool negated = false;
      switch (e) {
        case 's': case 'S':
          items = js ? kEcmaScriptSpaceItems : kOnigurumaSpaceItems;
          negated = e == 'S';
          break;
        case 'w': case 'W':
          items = js ? kEcmaScriptWordItems : kOnigurumaWordItems;
          negated = e == 'W';
          break;
        case 'd': case 'D':
          items = js ? kEcmaScriptDigitItems : kOnigurumaDigitItems;
          negated = e == 'D';
          break;
        case 'h': case 'H':
          items = kHexDigitItems;
          negated = e == 'H';
          break;
        case 'Q':
          return unsupported("\\Q...\\E quoting in pre-tokenizer pattern '{}'", pattern_in);
        default:
          break;
      }
      if (items.empty()) {
        out += c;
        out += e;
      } else if (!in_class) {
        out += negated ? "[^" : "[";
        out += items;
        out += ']';
      } else if (!negated) {
        out += items;
      } else {
        return unsupported("negated shorthand \\{} inside a character class in pre-tokenizer pattern '{}'", e,
                           pattern_in);
      }
      ++i;
      continue;
    }
    if (!in_class) {
      out += c;
      if (c == '[') {
        in_class = true;
        if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
        class_body_start = i + 1;
      }
      continue;
    }
    // Inside a class: POSIX classes like [:alpha:] are copied whole; a ']' right after the
    // opening bracket is a literal.
    if (c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      const size_t end = pattern.find(":]", i + 2);
      if (end != std::string::npos) {
        out.append(pattern, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    out += c;
    if (c == ']' && i != class_body_start) in_class = false;
  }
  return out;
}

Result<std::shared_ptr<const PretokenizerRegex>> PretokenizerRegex::compile(std::string_view pattern,
                                                                            TokenizerCompat compat,
                                                                            std::string_view what) {
  auto translated = translate_pattern(pattern, compat);
  if (!translated.ok()) return translated.status().with_context(std::string(what));
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated->data()), translated->size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return invalid_argument("{}: cannot compile regex '{}': {} at offset {}", what, pattern,
                            reinterpret_cast<const char*>(message), error_offset);
  }
  // JIT makes matching several times faster; without it (unsupported CPU) PCRE2 interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  std::shared_ptr<PretokenizerRegex> regex(new PretokenizerRegex());
  regex->pattern_ = std::string(pattern);
  regex->code_ = code;
  return std::shared_ptr<const PretokenizerRegex>(std::move(regex));
}

PretokenizerRegex::~PretokenizerRegex() {
  if (code_ != nullptr) pcre2_code_free(code_);
}

namespace {

// Match data and a JIT stack per thread: a compiled pattern is shared between threads, the
// scratch memory of a match is not.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchScratch() { pcre2_jit_stack_assign(context, nullptr, jit_stack); }
  ~MatchScratch() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

void PretokenizerRegex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  MatchScratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    int rc = pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, s.data, s.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // Pathological input for this pattern: retry with the interpreter, which keeps its
      // backtracking frames on the heap.
      rc = pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, s.data, s.context);
    }
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      // The rest of the text stays unmatched (a gap); never abort an encode for it.
      if (!g_warned_match_error.exchange(true)) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(rc, message, sizeof(message));
        MOELORA_LOG_WARN("pre-tokenizer regex '{}' failed on a {}-byte text: {}", pattern_, text.size(),
                         reinterpret_cast<const char*>(message));
      }
      return;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(s.data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches.emplace_back(begin, end);
      start = end;
    } else {
      // An empty match: step over one code point, as JavaScript and Rust iterators do.
      if (begin >= text.size()) return;
      start = begin + 1;
      while (start < text.size() && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
}

}  // namespace moelora
