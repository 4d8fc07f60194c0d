#include "tokenizer/text_pipeline.h"

#include <algorithm>

#include "tokenizer/byte_level.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

// ---------------------------------------------------------------------------------------------
// Normalizers

class NfcNormalizer final : public Normalizer {
 public:
  std::string normalize(std::string text) const override { return unicode::nfc(text); }
};

class NfdNormalizer final : public Normalizer {
 public:
  std::string normalize(std::string text) const override { return unicode::nfd(text); }
};

// Rust tokenizers lowercases character by character with the full mappings (no final-sigma rule).
class LowercaseNormalizer final : public Normalizer {
 public:
  std::string normalize(std::string text) const override {
    std::string out;
    out.reserve(text.size());
    size_t pos = 0;
    char32_t mapped[3];
    while (pos < text.size()) {
      const int n = unicode::to_lower(utf8::decode_valid(text, pos), mapped);
      for (int i = 0; i < n; ++i) utf8::append(out, mapped[i]);
    }
    return out;
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::string literal, std::shared_ptr<const PretokenizerRegex> regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}
  std::string normalize(std::string text) const override {
    std::vector<std::pair<size_t, size_t>> matches;
    if (regex_) {
      regex_->find_all(text, matches);
    } else if (!literal_.empty()) {
      for (size_t pos = text.find(literal_); pos != std::string::npos; pos = text.find(literal_, pos + literal_.size())) {
        matches.emplace_back(pos, pos + literal_.size());
      }
    }
    if (matches.empty()) return text;
    std::string out;
    size_t prev = 0;
    for (const auto& [begin, end] : matches) {
      out.append(text, prev, begin - prev);
      out += content_;
      prev = end;
    }
    out.append(text, prev);
    return out;
  }

 private:
  std::string literal_;
  std::shared_ptr<const PretokenizerRegex> regex_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string normalize(std::string text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string normalize(std::string text) const override {
    const std::u32string cps = utf8::to_code_points(text);
    size_t begin = 0, end = cps.size();
    if (left_) {
      while (begin < end && unicode::is_white_space(cps[begin])) ++begin;
    }
    if (right_) {
      while (end > begin && unicode::is_white_space(cps[end - 1])) --end;
    }
    return utf8::from_code_points(std::u32string_view(cps).substr(begin, end - begin));
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> stages) : stages_(std::move(stages)) {}
  std::string normalize(std::string text) const override {
    for (const auto& stage : stages_) text = stage->normalize(std::move(text));
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> stages_;
};

Result<std::string> type_of(const Json& config, std::string_view what) {
  if (!config.is_object()) return invalid_argument("{} must be an object or null", what);
  return json_get_string(config, "type", what);
}

// A "pattern" object: {"String": "..."} or {"Regex": "..."}.
struct Pattern {
  std::string literal;
  std::shared_ptr<const PretokenizerRegex> regex;
};

Result<Pattern> parse_pattern(const Json& config, TokenizerCompat compat, std::string_view what) {
  const auto it = config.find("pattern");
  if (it == config.end() || !it->is_object()) {
    return invalid_argument("{}: \"pattern\" must be {{\"String\": ...}} or {{\"Regex\": ...}}", what);
  }
  Pattern p;
  if (auto s = it->find("String"); s != it->end() && s->is_string()) {
    p.literal = s->get<std::string>();
    return p;
  }
  if (auto r = it->find("Regex"); r != it->end() && r->is_string()) {
    MOELORA_ASSIGN_OR_RETURN(p.regex, PretokenizerRegex::compile(r->get<std::string>(), compat, what));
    return p;
  }
  return invalid_argument("{}: \"pattern\" must be {{\"String\": ...}} or {{\"Regex\": ...}}", what);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<std::string>& pieces, bool* first_at_start) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size() * 2);
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const std::string& piece = pieces[i];
      matches.clear();
      if (pattern_.regex) {
        pattern_.regex->find_all(piece, matches);
      } else if (!pattern_.literal.empty()) {
        const std::string& lit = pattern_.literal;
        for (size_t pos = piece.find(lit); pos != std::string::npos; pos = piece.find(lit, pos + lit.size())) {
          matches.emplace_back(pos, pos + lit.size());
        }
      }
      size_t first_begin = 0;
      for (std::string& s : split_by_matches(piece, matches, behavior_, invert_, &first_begin)) out.push_back(std::move(s));
      // A removed delimiter at the front moves the first piece away from the input's start.
      if (i == 0 && first_begin != 0) *first_at_start = false;
    }
    pieces = std::move(out);
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const PretokenizerRegex> gpt2_regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(gpt2_regex)) {}
  void pre_tokenize(std::vector<std::string>& pieces, bool* /*first_at_start*/) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size());
    std::vector<std::pair<size_t, size_t>> matches;
    for (std::string& piece : pieces) {
      if (add_prefix_space_ && !piece.starts_with(' ')) piece.insert(piece.begin(), ' ');
      if (regex_) {
        matches.clear();
        regex_->find_all(piece, matches);
        for (std::string& s : split_by_matches(piece, matches, SplitBehavior::kIsolated, false)) {
          out.push_back(to_symbols(s));
        }
      } else if (!piece.empty()) {
        out.push_back(to_symbols(piece));
      }
    }
    pieces = std::move(out);
  }

 private:
  static std::string to_symbols(std::string_view bytes) {
    std::string s;
    s.reserve(bytes.size() * 2);
    byte_level::encode(bytes, s);
    return s;
  }
  bool add_prefix_space_;
  std::shared_ptr<const PretokenizerRegex> regex_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> stages) : stages_(std::move(stages)) {}
  void pre_tokenize(std::vector<std::string>& pieces, bool* first_at_start) const override {
    for (const auto& stage : stages_) stage->pre_tokenize(pieces, first_at_start);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> stages_;
};

// SentencePiece's whitespace convention (Llama 2, Mistral, Mixtral): spaces become the
// replacement character (U+2581 '▁'), one is put in front of the text, and with `split` each
// piece is cut before every replacement character (Rust's MergedWithNext). prepend_scheme
// "first" only prepends to the piece that starts the input, so text after an added token
// such as [INST] gets no extra '▁'.
enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void pre_tokenize(std::vector<std::string>& pieces, bool* first_at_start) const override {
    std::vector<std::string> out;
    out.reserve(pieces.size());
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string text = replace_spaces(pieces[i]);
      const bool prepend = scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && i == 0 && *first_at_start);
      if (prepend && !text.starts_with(replacement_)) text.insert(0, replacement_);
      if (!split_) {
        if (!text.empty()) out.push_back(std::move(text));
        continue;
      }
      matches.clear();
      for (size_t pos = text.find(replacement_); pos != std::string::npos; pos = text.find(replacement_, pos + replacement_.size())) {
        matches.emplace_back(pos, pos + replacement_.size());
      }
      for (std::string& s : split_by_matches(text, matches, SplitBehavior::kMergedWithNext, false)) out.push_back(std::move(s));
    }
    pieces = std::move(out);
  }

 private:
  std::string replace_spaces(const std::string& text) const {
    if (text.find(' ') == std::string::npos) return text;
    std::string out;
    out.reserve(text.size() + text.size() / 2);
    for (char c : text) {
      if (c == ' ') out += replacement_;
      else out += c;
    }
    return out;
  }
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

// GPT-2's own splitting, used by a ByteLevel pre-tokenizer with use_regex (the default).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Result<SplitBehavior> parse_behavior(const Json& config, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto name, json_get_string(config, "behavior", what));
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return invalid_argument("{}: unknown split behavior '{}'", what, name);
}

}  // namespace

Result<std::unique_ptr<Normalizer>> make_normalizer(const Json& config, TokenizerCompat compat,
                                                    std::string_view what) {
  if (config.is_null()) return std::unique_ptr<Normalizer>();
  MOELORA_ASSIGN_OR_RETURN(auto type, type_of(config, what));
  if (type == "NFC") return std::unique_ptr<Normalizer>(new NfcNormalizer());
  if (type == "NFD") return std::unique_ptr<Normalizer>(new NfdNormalizer());
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (type == "Sequence") {
    const auto it = config.find("normalizers");
    if (it == config.end() || !it->is_array()) return invalid_argument("{}: Sequence needs a \"normalizers\" array", what);
    std::vector<std::unique_ptr<Normalizer>> stages;
    for (size_t i = 0; i < it->size(); ++i) {
      MOELORA_ASSIGN_OR_RETURN(auto stage, make_normalizer((*it)[i], compat, fmt::format("{}.normalizers[{}]", what, i)));
      if (stage) stages.push_back(std::move(stage));
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(stages)));
  }
  if (type == "Replace") {
    MOELORA_ASSIGN_OR_RETURN(auto pattern, parse_pattern(config, compat, what));
    MOELORA_ASSIGN_OR_RETURN(auto content, json_get_string(config, "content", what));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(pattern.literal, pattern.regex, content));
  }
  if (type == "Prepend") {
    MOELORA_ASSIGN_OR_RETURN(auto prefix, json_get_string(config, "prepend", what));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(prefix));
  }
  if (type == "Strip") {
    MOELORA_ASSIGN_OR_RETURN(auto left, json_opt_bool(config, "strip_left", what));
    MOELORA_ASSIGN_OR_RETURN(auto right, json_opt_bool(config, "strip_right", what));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left.value_or(true), right.value_or(true)));
  }
  return unsupported("{}: normalizer type '{}' is not supported (supported: NFC, NFD, Lowercase, Replace, "
                     "Prepend, Strip, Sequence)",
                     what, type);
}

Result<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const Json& config, TokenizerCompat compat,
                                                         std::string_view what) {
  if (config.is_null()) return std::unique_ptr<PreTokenizer>();
  MOELORA_ASSIGN_OR_RETURN(auto type, type_of(config, what));
  if (type == "Sequence") {
    const auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array()) {
      return invalid_argument("{}: Sequence needs a \"pretokenizers\" array", what);
    }
    std::vector<std::unique_ptr<PreTokenizer>> stages;
    for (size_t i = 0; i < it->size(); ++i) {
      MOELORA_ASSIGN_OR_RETURN(auto stage,
                               make_pre_tokenizer((*it)[i], compat, fmt::format("{}.pretokenizers[{}]", what, i)));
      if (stage) stages.push_back(std::move(stage));
    }
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(stages)));
  }
  if (type == "Split") {
    MOELORA_ASSIGN_OR_RETURN(auto pattern, parse_pattern(config, compat, what));
    MOELORA_ASSIGN_OR_RETURN(auto behavior, parse_behavior(config, what));
    MOELORA_ASSIGN_OR_RETURN(auto invert, json_opt_bool(config, "invert", what));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(std::move(pattern), behavior, invert.value_or(false)));
  }
  if (type == "ByteLevel") {
    MOELORA_ASSIGN_OR_RETURN(auto add_prefix_space, json_opt_bool(config, "add_prefix_space", what));
    MOELORA_ASSIGN_OR_RETURN(auto use_regex, json_opt_bool(config, "use_regex", what));
    std::shared_ptr<const PretokenizerRegex> regex;
    if (use_regex.value_or(true)) {
      MOELORA_ASSIGN_OR_RETURN(regex, PretokenizerRegex::compile(kGpt2Pattern, compat, what));
    }
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(add_prefix_space.value_or(true), regex));
  }
  if (type == "Metaspace") {
    MOELORA_ASSIGN_OR_RETURN(auto replacement, json_get_string(config, "replacement", what));
    if (utf8::to_code_points(replacement).size() != 1 || !utf8::is_valid(replacement)) {
      return invalid_argument("{}: Metaspace \"replacement\" must be one character", what);
    }
    // tokenizers >= 0.19 writes prepend_scheme; older files only add_prefix_space (which meant
    // "always"). A file with both (0.15-0.18) is decided by prepend_scheme.
    MOELORA_ASSIGN_OR_RETURN(auto scheme_name, json_opt_string(config, "prepend_scheme", what));
    MOELORA_ASSIGN_OR_RETURN(auto add_prefix_space, json_opt_bool(config, "add_prefix_space", what));
    MOELORA_ASSIGN_OR_RETURN(auto split, json_opt_bool(config, "split", what));
    PrependScheme scheme = add_prefix_space.value_or(true) ? PrependScheme::kAlways : PrependScheme::kNever;
    if (scheme_name) {
      if (*scheme_name == "always") scheme = PrependScheme::kAlways;
      else if (*scheme_name == "first") scheme = PrependScheme::kFirst;
      else if (*scheme_name == "never") scheme = PrependScheme::kNever;
      else return invalid_argument("{}: unknown Metaspace prepend_scheme '{}' (always, first, never)", what, *scheme_name);
    }
    return std::unique_ptr<PreTokenizer>(new MetaspacePreTokenizer(replacement, scheme, split.value_or(true)));
  }
  return unsupported("{}: pre-tokenizer type '{}' is not supported (supported: Split, ByteLevel, Metaspace, Sequence)",
                     what, type);
}

std::vector<std::string> split_by_matches(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches,
                                          SplitBehavior behavior, bool invert, size_t* first_begin) {
  // Segments covering the text: gaps and matches, each flagged as a delimiter or not.
  struct Segment {
    size_t begin, end;
    bool delimiter;
  };
  std::vector<Segment> segments;
  size_t prev = 0;
  for (const auto& [begin, end] : matches) {
    if (begin > prev) segments.push_back({prev, begin, invert});
    segments.push_back({begin, end, !invert});
    prev = end;
  }
  if (prev < text.size()) segments.push_back({prev, text.size(), invert});

  std::vector<std::pair<size_t, size_t>> pieces;
  bool previous_delimiter = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.delimiter) pieces.emplace_back(s.begin, s.end);
      }
      break;
    case SplitBehavior::kIsolated:
      for (const Segment& s : segments) pieces.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (s.delimiter && !previous_delimiter && !pieces.empty()) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.begin, s.end);
        }
        previous_delimiter = s.delimiter;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->delimiter && !previous_delimiter && !pieces.empty()) {
          pieces.back().first = it->begin;
        } else {
          pieces.emplace_back(it->begin, it->end);
        }
        previous_delimiter = it->delimiter;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (s.delimiter == previous_delimiter && !pieces.empty()) {
          pieces.back().second = s.end;
        } else {
          pieces.emplace_back(s.begin, s.end);
        }
        previous_delimiter = s.delimiter;
      }
      break;
  }
  std::vector<std::string> out;
  out.reserve(pieces.size());
  if (first_begin != nullptr) *first_begin = text.size();
  for (const auto& [begin, end] : pieces) {
    if (end <= begin) continue;
    if (first_begin != nullptr && out.empty()) *first_begin = begin;
    out.emplace_back(text.substr(begin, end - begin));
  }
  return out;
}

}  // namespace moelora
