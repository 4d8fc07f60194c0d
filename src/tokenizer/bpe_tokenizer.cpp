#include "tokenizer/bpe_tokenizer.h"

#include <algorithm>

#include "io/mapped_file.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

Result<std::vector<AddedToken>> parse_added_tokens(const Json& root, std::string_view what) {
  std::vector<AddedToken> tokens;
  const auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return tokens;
  if (!it->is_array()) return invalid_argument("{}: \"added_tokens\" must be an array", what);
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& t = (*it)[i];
    const std::string where = fmt::format("{}: added_tokens[{}]", what, i);
    if (!t.is_object()) return invalid_argument("{} must be an object", where);
    AddedToken token;
    MOELORA_ASSIGN_OR_RETURN(auto id, json_get_int(t, "id", where));
    if (id < 0 || id > INT32_MAX) return invalid_argument("{}: id {} is out of range", where, id);
    token.id = static_cast<int32_t>(id);
    MOELORA_ASSIGN_OR_RETURN(token.content, json_get_string(t, "content", where));
    MOELORA_ASSIGN_OR_RETURN(auto special, json_opt_bool(t, "special", where));
    MOELORA_ASSIGN_OR_RETURN(auto lstrip, json_opt_bool(t, "lstrip", where));
    MOELORA_ASSIGN_OR_RETURN(auto rstrip, json_opt_bool(t, "rstrip", where));
    MOELORA_ASSIGN_OR_RETURN(auto single_word, json_opt_bool(t, "single_word", where));
    MOELORA_ASSIGN_OR_RETURN(auto normalized, json_opt_bool(t, "normalized", where));
    token.special = special.value_or(false);
    token.lstrip = lstrip.value_or(false);
    token.rstrip = rstrip.value_or(false);
    token.single_word = single_word.value_or(false);
    // Rust's default: special tokens are not normalized, others are.
    token.normalized = normalized.value_or(!token.special);
    if (!utf8::is_valid(token.content)) return invalid_argument("{}: content is not valid UTF-8", where);
    tokens.push_back(std::move(token));
  }
  return tokens;
}

struct SpecialTemplate {
  std::vector<int32_t> prefix, suffix;
};

Result<SpecialTemplate> parse_post_processor(const Json& config, std::string_view what,
                                             const std::function<std::optional<int32_t>(const std::string&)>& id_of) {
  SpecialTemplate result;
  if (config.is_null()) return result;
  MOELORA_ASSIGN_OR_RETURN(auto type, json_get_string(config, "type", what));
  if (type == "ByteLevel") return result;  // offsets only
  if (type == "Sequence") {
    const auto it = config.find("processors");
    if (it == config.end() || !it->is_array()) return invalid_argument("{}: Sequence needs \"processors\"", what);
    for (const Json& p : *it) {
      MOELORA_ASSIGN_OR_RETURN(auto part, parse_post_processor(p, what, id_of));
      result.prefix.insert(result.prefix.end(), part.prefix.begin(), part.prefix.end());
      result.suffix.insert(result.suffix.end(), part.suffix.begin(), part.suffix.end());
    }
    return result;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const auto cls = config.find("cls");
    const auto sep = config.find("sep");
    if (cls == config.end() || sep == config.end() || !cls->is_array() || cls->size() != 2 || !sep->is_array() ||
        sep->size() != 2 || !(*cls)[1].is_number_integer() || !(*sep)[1].is_number_integer()) {
      return invalid_argument("{}: {} needs \"cls\" and \"sep\" as [token, id]", what, type);
    }
    result.prefix.push_back((*cls)[1].get<int32_t>());
    result.suffix.push_back((*sep)[1].get<int32_t>());
    return result;
  }
  if (type == "TemplateProcessing") {
    const auto single = config.find("single");
    const auto specials = config.find("special_tokens");
    if (single == config.end() || !single->is_array()) return invalid_argument("{}: \"single\" must be an array", what);
    bool after_sequence = false;
    for (const Json& item : *single) {
      if (item.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      const auto st = item.find("SpecialToken");
      if (st == item.end() || !st->is_object() || !st->contains("id") || !(*st)["id"].is_string()) {
        return invalid_argument("{}: template item {} is neither Sequence nor SpecialToken", what, item.dump());
      }
      const std::string name = (*st)["id"].get<std::string>();
      std::vector<int32_t> ids;
      if (specials != config.end() && specials->is_object() && specials->contains(name)) {
        const Json& entry = (*specials)[name];
        if (entry.contains("ids") && entry["ids"].is_array()) {
          for (const Json& id : entry["ids"]) {
            if (!id.is_number_integer()) return invalid_argument("{}: special token '{}' has a bad id", what, name);
            ids.push_back(id.get<int32_t>());
          }
        }
      } else if (auto id = id_of(name)) {
        ids.push_back(*id);
      } else {
        return invalid_argument("{}: template special token '{}' is not in the vocabulary", what, name);
      }
      auto& dst = after_sequence ? result.suffix : result.prefix;
      dst.insert(dst.end(), ids.begin(), ids.end());
    }
    return result;
  }
  return unsupported("{}: post-processor type '{}' is not supported (supported: ByteLevel, TemplateProcessing, "
                     "RobertaProcessing, BertProcessing, Sequence)",
                     what, type);
}

}  // namespace

Result<std::shared_ptr<BpeTokenizer>> BpeTokenizer::from_file(const std::string& path,
                                                              const BpeTokenizerOptions& options) {
  MOELORA_ASSIGN_OR_RETURN(auto text, read_text_file(path, size_t{256} << 20));
  return from_json_text(text, path, options);
}

Result<std::shared_ptr<BpeTokenizer>> BpeTokenizer::from_json_text(std::string_view json_text, std::string_view what,
                                                                   const BpeTokenizerOptions& options) {
  MOELORA_ASSIGN_OR_RETURN(Json root, parse_json_strict(json_text, what));
  if (!root.is_object()) return invalid_argument("{}: a tokenizer.json must be an object", what);
  const auto field = [&](const char* key) -> const Json& {
    static const Json null_json;
    auto it = root.find(key);
    return it == root.end() ? null_json : *it;
  };

  std::shared_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->options_ = options;
  const std::string where(what);
  MOELORA_ASSIGN_OR_RETURN(t->model_, BpeModel::from_json(field("model"), where));
  MOELORA_ASSIGN_OR_RETURN(t->normalizer_, make_normalizer(field("normalizer"), options.compat, where + ": normalizer"));
  MOELORA_ASSIGN_OR_RETURN(t->pre_tokenizer_,
                           make_pre_tokenizer(field("pre_tokenizer"), options.compat, where + ": pre_tokenizer"));
  MOELORA_ASSIGN_OR_RETURN(t->decoder_, TokenDecoder::from_json(field("decoder"), options.compat, where + ": decoder"));
  MOELORA_ASSIGN_OR_RETURN(t->added_tokens_, parse_added_tokens(root, where));

  std::vector<std::string> normalized_contents;
  int32_t max_id = t->model_.id_limit() - 1;
  for (size_t i = 0; i < t->added_tokens_.size(); ++i) {
    const AddedToken& token = t->added_tokens_[i];
    normalized_contents.push_back(t->normalizer_ ? t->normalizer_->normalize(token.content) : token.content);
    t->added_by_content_[token.content] = token.id;
    t->added_index_by_id_[token.id] = i;
    max_id = std::max(max_id, token.id);
  }
  t->raw_matcher_ = AddedTokenMatcher(t->added_tokens_, normalized_contents, false, options.compat);
  t->normalized_matcher_ = AddedTokenMatcher(t->added_tokens_, normalized_contents, true, options.compat);
  t->vocab_size_ = max_id + 1;

  const auto id_of = [&t](const std::string& token) { return t->token_to_id(token); };
  MOELORA_ASSIGN_OR_RETURN(auto special, parse_post_processor(field("post_processor"), where + ": post_processor", id_of));
  t->prefix_ids_ = std::move(special.prefix);
  t->suffix_ids_ = std::move(special.suffix);

  // Bytes of every vocabulary token, computed once so that decoding is a lookup.
  t->token_bytes_.resize(static_cast<size_t>(t->model_.id_limit()));
  for (int32_t id = 0; id < t->model_.id_limit(); ++id) {
    const std::string* token = t->model_.id_to_token(id);
    if (token != nullptr) t->token_bytes_[id] = t->decoder_.token_bytes(*token, /*first=*/false);
  }
  return t;
}

void BpeTokenizer::set_special_token_template(std::vector<int32_t> prefix, std::vector<int32_t> suffix) {
  prefix_ids_ = std::move(prefix);
  suffix_ids_ = std::move(suffix);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  std::string valid = utf8::is_valid(text) ? std::string(text) : utf8::sanitize(text);
  std::vector<AddedTokenMatcher::Segment> segments;
  raw_matcher_.split(valid, segments);
  for (const auto& s : segments) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else {
      encode_ordinary(valid.substr(s.begin, s.end - s.begin), s.begin == 0, ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

void BpeTokenizer::encode_ordinary(std::string text, bool at_start, std::vector<int32_t>& ids) const {
  if (normalizer_) text = normalizer_->normalize(std::move(text));
  if (normalized_matcher_.empty()) {
    encode_normalized(text, at_start, ids);
    return;
  }
  std::vector<AddedTokenMatcher::Segment> segments;
  normalized_matcher_.split(text, segments);
  for (const auto& s : segments) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else {
      encode_normalized(std::string_view(text).substr(s.begin, s.end - s.begin), at_start && s.begin == 0, ids);
    }
  }
}

void BpeTokenizer::encode_normalized(std::string_view text, bool at_start, std::vector<int32_t>& ids) const {
  if (text.empty()) return;
  std::vector<std::string> pieces{std::string(text)};
  if (pre_tokenizer_) pre_tokenizer_->pre_tokenize(pieces, &at_start);
  for (const std::string& piece : pieces) model_.encode_word(piece, ids);
}

BpeTokenizer::Piece BpeTokenizer::piece(int32_t id) const {
  Piece p;
  if (auto it = added_index_by_id_.find(id); it != added_index_by_id_.end()) {
    const AddedToken& token = added_tokens_[it->second];
    p.kind = Piece::kAddedToken;
    p.special = token.special;
    p.text = token.content;
    return p;
  }
  if (id >= 0 && static_cast<size_t>(id) < token_bytes_.size() && model_.id_to_token(id) != nullptr) {
    p.kind = Piece::kBytes;
    p.text = token_bytes_[id];
  }
  return p;
}

std::string BpeTokenizer::first_piece_bytes(int32_t id) const {
  const Piece p = piece(id);
  if (p.kind != Piece::kBytes || !decoder_.has_first_token_rule()) return std::string(p.text);
  return decoder_.token_bytes(*model_.id_to_token(id), /*first=*/true);
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string out;
  std::string bytes;  // token bytes not yet turned into characters
  const auto flush = [&] {
    out += utf8::is_valid(bytes) ? bytes : utf8::sanitize(bytes);
    bytes.clear();
  };
  bool first = true;  // the decoder's first-token rule applies to the first token kept
  for (int32_t id : ids) {
    const Piece p = piece(id);
    switch (p.kind) {
      case Piece::kNone:
        break;
      case Piece::kBytes:
        if (first) bytes += first_piece_bytes(id);
        else bytes.append(p.text);
        first = false;
        break;
      case Piece::kAddedToken:
        if (skip_special_tokens && p.special) break;
        flush();
        out.append(p.text);
        first = false;
        break;
    }
  }
  flush();
  int budget = decoder_.lead_strip_count();
  strip_leading(out, decoder_.lead_strip_char(), &budget);
  return out;
}

std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  if (auto it = added_by_content_.find(std::string(token)); it != added_by_content_.end()) return it->second;
  return model_.token_to_id(token);
}

std::optional<std::string> BpeTokenizer::id_to_token(int32_t id) const {
  if (auto it = added_index_by_id_.find(id); it != added_index_by_id_.end()) return added_tokens_[it->second].content;
  if (const std::string* token = model_.id_to_token(id)) return *token;
  return std::nullopt;
}

bool BpeTokenizer::is_special(int32_t id) const {
  const Piece p = piece(id);
  return p.kind == Piece::kAddedToken && p.special;
}

}  // namespace moelora
