#include "tokenizer/token_decoder.h"

#include "tokenizer/byte_level.h"
#include "tokenizer/text_pipeline.h"
#include "tokenizer/utf8.h"

namespace moelora {

struct TokenDecoder::Step {
  enum Kind { kByteLevel, kReplace, kByteFallback, kMetaspace, kStrip } kind;
  std::shared_ptr<const Normalizer> replace;  // kReplace: the same object Rust uses as a normalizer
  std::string replacement;                    // kMetaspace
  char32_t strip_char = U' ';                 // kStrip
  int strip_start = 0, strip_stop = 0;
};

TokenDecoder::TokenDecoder() = default;
TokenDecoder::~TokenDecoder() = default;
TokenDecoder::TokenDecoder(TokenDecoder&&) noexcept = default;
TokenDecoder& TokenDecoder::operator=(TokenDecoder&&) noexcept = default;

namespace {

// "<0x0A>" -> 0x0A, as Rust's ByteFallback reads it (exactly six bytes, two hex digits).
std::optional<uint8_t> byte_token(std::string_view s) {
  if (s.size() != 6 || !s.starts_with("<0x") || s[5] != '>') return std::nullopt;
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(s[3]), lo = hex(s[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

Result<char32_t> one_char(const Json& config, const char* key, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto s, json_get_string(config, key, what));
  const std::u32string cps = utf8::is_valid(s) ? utf8::to_code_points(s) : std::u32string();
  if (cps.size() != 1) return invalid_argument("{}: \"{}\" must be one character", what, key);
  return cps[0];
}

Result<int> small_count(const Json& config, const char* key, std::string_view what) {
  MOELORA_ASSIGN_OR_RETURN(auto v, json_opt_int(config, key, what));
  if (v.value_or(0) < 0 || v.value_or(0) > 64) return invalid_argument("{}: \"{}\" must be 0..64", what, key);
  return static_cast<int>(v.value_or(0));
}

// Removes up to `start` leading and `stop` trailing `c` characters, as Rust's Strip does to
// each token.
std::string strip_token(const std::string& token, char32_t c, int start, int stop) {
  std::u32string cps = utf8::to_code_points(token);
  size_t begin = 0, end = cps.size();
  while (begin < end && static_cast<int>(begin) < start && cps[begin] == c) ++begin;
  int cut = 0;
  while (end > begin && cut < stop && cps[end - 1] == c) --end, ++cut;
  return utf8::from_code_points(std::u32string_view(cps).substr(begin, end - begin));
}

}  // namespace

Result<TokenDecoder> TokenDecoder::from_json(const Json& config, TokenizerCompat compat, std::string_view what) {
  if (!config.is_object()) {
    return unsupported("{}: a decoder is required (ByteLevel, or SentencePiece's Metaspace / Replace + ByteFallback "
                       "+ Fuse + Strip)",
                       what);
  }
  // The chain, with Sequences flattened in order.
  std::vector<const Json*> chain;
  const auto flatten = [&](auto&& self, const Json& d, int depth) -> Status {
    if (depth > 16) return invalid_argument("{}: decoder Sequences are nested too deeply", what);
    if (!d.is_object()) return invalid_argument("{}: every decoder must be an object", what);
    MOELORA_ASSIGN_OR_RETURN(auto type, json_get_string(d, "type", what));
    if (type != "Sequence") {
      chain.push_back(&d);
      return {};
    }
    const auto it = d.find("decoders");
    if (it == d.end() || !it->is_array()) return invalid_argument("{}: Sequence needs a \"decoders\" array", what);
    for (const Json& inner : *it) MOELORA_RETURN_IF_ERROR(self(self, inner, depth + 1));
    return {};
  };
  MOELORA_RETURN_IF_ERROR(flatten(flatten, config, 0));

  TokenDecoder d;
  bool fused = false;
  for (size_t i = 0; i < chain.size(); ++i) {
    const Json& step = *chain[i];
    const std::string where = fmt::format("{} (decoder step {})", what, i);
    MOELORA_ASSIGN_OR_RETURN(auto type, json_get_string(step, "type", where));
    if (fused && type != "Strip" && type != "Fuse") {
      return unsupported("{}: decoder '{}' after Fuse works on the whole text, which streaming cannot reproduce "
                         "(supported after Fuse: Strip of leading characters)",
                         where, type);
    }
    Step s{};
    if (type == "ByteLevel") {
      s.kind = Step::kByteLevel;
    } else if (type == "ByteFallback") {
      s.kind = Step::kByteFallback;
    } else if (type == "Fuse") {
      fused = true;  // concatenation: what every decode already does
      continue;
    } else if (type == "Replace") {
      s.kind = Step::kReplace;
      MOELORA_ASSIGN_OR_RETURN(auto n, make_normalizer(step, compat, where));
      s.replace = std::shared_ptr<const Normalizer>(std::move(n));
    } else if (type == "Metaspace") {
      s.kind = Step::kMetaspace;
      MOELORA_ASSIGN_OR_RETURN(auto rep, one_char(step, "replacement", where));
      utf8::append(s.replacement, rep);
      MOELORA_ASSIGN_OR_RETURN(auto scheme, json_opt_string(step, "prepend_scheme", where));
      MOELORA_ASSIGN_OR_RETURN(auto add_prefix_space, json_opt_bool(step, "add_prefix_space", where));
      if (compat == TokenizerCompat::kTransformersJs) {
        // transformers.js reads only add_prefix_space and removes one leading space of token 0.
        if (add_prefix_space.value_or(false)) d.metaspace_first_ = MetaspaceFirst::kDropOneSpace;
      } else {
        const bool never = scheme ? *scheme == "never" : !add_prefix_space.value_or(true);
        if (!never) d.metaspace_first_ = MetaspaceFirst::kDropAll;
      }
    } else if (type == "Strip") {
      MOELORA_ASSIGN_OR_RETURN(auto c, one_char(step, "content", where));
      MOELORA_ASSIGN_OR_RETURN(auto start, small_count(step, "start", where));
      MOELORA_ASSIGN_OR_RETURN(auto stop, small_count(step, "stop", where));
      if (fused) {
        if (stop > 0) {
          return unsupported("{}: Strip with stop > 0 after Fuse removes characters at the end of the whole text, "
                             "which a stream cannot know",
                             where);
        }
        if (d.lead_strip_count_ > 0 && c != d.lead_strip_char_) {
          return unsupported("{}: two Strip decoders after Fuse with different characters", where);
        }
        d.lead_strip_char_ = c;
        d.lead_strip_count_ += start;
        continue;
      }
      s.kind = Step::kStrip;
      s.strip_char = c;
      s.strip_start = start;
      s.strip_stop = stop;
    } else {
      return unsupported("{}: decoder type '{}' is not supported (supported: ByteLevel, Metaspace, Replace, "
                         "ByteFallback, Fuse, Strip, Sequence)",
                         where, type);
    }
    d.steps_.push_back(std::move(s));
  }
  return d;
}

std::string TokenDecoder::token_bytes(std::string_view token, bool first) const {
  std::string s(token);
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::kByteLevel: {
        // A token that is not made of byte-level symbols is kept as its text (as Rust does).
        std::string bytes;
        if (byte_level::decode(s, bytes)) s = std::move(bytes);
        break;
      }
      case Step::kByteFallback:
        // The raw byte; what follows in the chain would see the decoded run as one string in
        // Rust, which only matters for runs that spell a replacement character (never: '▁' is
        // always in a SentencePiece vocabulary).
        if (auto b = byte_token(s)) return std::string(1, static_cast<char>(*b));
        break;
      case Step::kReplace:
        if (utf8::is_valid(s)) s = step.replace->normalize(std::move(s));
        break;
      case Step::kMetaspace: {
        const bool drop_all = first && metaspace_first_ == MetaspaceFirst::kDropAll;
        std::string out;
        out.reserve(s.size());
        for (size_t pos = 0; pos < s.size();) {
          if (s.compare(pos, step.replacement.size(), step.replacement) == 0) {
            if (!drop_all) out += ' ';
            pos += step.replacement.size();
          } else {
            out += s[pos++];
          }
        }
        if (first && metaspace_first_ == MetaspaceFirst::kDropOneSpace && out.starts_with(' ')) out.erase(0, 1);
        s = std::move(out);
        break;
      }
      case Step::kStrip:
        if (utf8::is_valid(s)) s = strip_token(s, step.strip_char, step.strip_start, step.strip_stop);
        break;
    }
  }
  return s;
}

void strip_leading(std::string& text, char32_t c, int* budget) {
  if (*budget <= 0 || text.empty()) return;
  size_t pos = 0;
  while (*budget > 0 && pos < text.size()) {
    size_t next = pos;
    if (utf8::decode_valid(text, next) != c) break;
    pos = next;
    --*budget;
  }
  text.erase(0, pos);
  if (!text.empty()) *budget = 0;
}

}  // namespace moelora
