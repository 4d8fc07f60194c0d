#include "tokenizer/tokenizer_dir.h"

#include <algorithm>
#include <filesystem>

#include "core/log.h"
#include "io/json_util.h"
#include "io/mapped_file.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;

// A special token in tokenizer_config.json: a string, or an AddedToken object
// ({"__type": "AddedToken", "content": ...} or just {"content": ...}); null means none.
Result<std::optional<std::string>> token_content(const Json& config, std::string_view key, std::string_view what) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return std::optional<std::string>((*it)["content"].get<std::string>());
  }
  return invalid_argument("{}: \"{}\" must be a string, an AddedToken object or null", what, key);
}

}  // namespace

Result<std::shared_ptr<Tokenizer>> Tokenizer::load(const std::string& dir, const TokenizerOptions& options) {
  std::shared_ptr<Tokenizer> t(new Tokenizer());
  t->dir_ = dir;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return not_found("tokenizer directory '{}' does not exist", dir);
  const fs::path tokenizer_json = root / "tokenizer.json";
  if (!fs::exists(tokenizer_json, ec)) {
    return not_found("{} is missing: moelora reads Hugging Face fast tokenizers (tokenizer.json)",
                     tokenizer_json.string());
  }
  BpeTokenizerOptions bpe_options;
  bpe_options.compat = options.compat;
  MOELORA_ASSIGN_OR_RETURN(t->bpe_, BpeTokenizer::from_file(tokenizer_json.string(), bpe_options));

  const fs::path config = root / "tokenizer_config.json";
  if (fs::exists(config, ec)) MOELORA_RETURN_IF_ERROR(t->load_config(config.string()));
  const fs::path generation_config = root / "generation_config.json";
  if (fs::exists(generation_config, ec)) MOELORA_RETURN_IF_ERROR(t->load_generation_config(generation_config.string()));

  // Newer checkpoints keep the template in its own file, which then takes precedence.
  const fs::path jinja_file = root / "chat_template.jinja";
  if (fs::exists(jinja_file, ec)) {
    MOELORA_ASSIGN_OR_RETURN(auto source, read_text_file(jinja_file.string()));
    auto compiled = ChatTemplate::compile(source, t->special_tokens_);
    t->templates_.clear();
    t->template_sources_ = {source};
    if (compiled.ok()) {
      t->templates_["default"] = *compiled;
      t->template_error_ = Status();
    } else {
      t->template_error_ = compiled.status().with_context(jinja_file.string());
    }
  }
  if (!t->template_error_.ok()) {
    MOELORA_LOG_WARN("{}: the chat template cannot be used: {}", dir, t->template_error_.message());
  }
  return t;
}

Status Tokenizer::load_config(const std::string& path) {
  MOELORA_ASSIGN_OR_RETURN(auto text, read_text_file(path));
  MOELORA_ASSIGN_OR_RETURN(Json config, parse_json_strict(text, path));
  if (!config.is_object()) return invalid_argument("{} must be a JSON object", path);

  // The special tokens every chat template sees (transformers' special_tokens_map).
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    MOELORA_ASSIGN_OR_RETURN(auto content, token_content(config, key, path));
    if (content) special_tokens_[key] = *content;
    if (std::string_view(key) == "bos_token") bos_token_ = content;
    if (std::string_view(key) == "eos_token") eos_token_ = content;
  }
  if (auto it = config.find("additional_special_tokens"); it != config.end() && it->is_array()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const Json& item : *it) {
      if (item.is_string()) list.push_back(item.get<std::string>());
      else if (item.is_object() && item.contains("content") && item["content"].is_string()) list.push_back(item["content"].get<std::string>());
    }
    special_tokens_["additional_special_tokens"] = std::move(list);
  }
  const auto resolve = [&](const std::optional<std::string>& token, const char* name) -> std::optional<int32_t> {
    if (!token) return std::nullopt;
    auto id = bpe_->token_to_id(*token);
    if (!id) MOELORA_LOG_WARN("{}: {} '{}' is not in the vocabulary", path, name, *token);
    return id;
  };
  bos_id_ = resolve(bos_token_, "bos_token");
  eos_id_ = resolve(eos_token_, "eos_token");
  if (eos_id_) eos_ids_.push_back(*eos_id_);

  // add_bos_token / add_eos_token decide the special tokens of a plain encode, as transformers'
  // Llama-family fast tokenizers rebuild their post-processor from them (DeepSeek-V3's BOS).
  MOELORA_ASSIGN_OR_RETURN(auto add_bos, json_opt_bool(config, "add_bos_token", path));
  MOELORA_ASSIGN_OR_RETURN(auto add_eos, json_opt_bool(config, "add_eos_token", path));
  if (add_bos || add_eos) {
    std::vector<int32_t> prefix = bpe_->prefix_ids(), suffix = bpe_->suffix_ids();
    if (add_bos) {
      prefix.clear();
      if (*add_bos && bos_id_) prefix.push_back(*bos_id_);
    }
    if (add_eos) {
      suffix.clear();
      if (*add_eos && eos_id_) suffix.push_back(*eos_id_);
    }
    bpe_->set_special_token_template(std::move(prefix), std::move(suffix));
  }

  // chat_template: one string, or a list of {"name", "template"}.
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return {};
  std::vector<std::pair<std::string, std::string>> sources;
  if (it->is_string()) {
    sources.emplace_back("default", it->get<std::string>());
  } else if (it->is_array()) {
    for (const Json& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") || !entry["name"].is_string() ||
          !entry["template"].is_string()) {
        return invalid_argument("{}: chat_template entries must be {{\"name\": ..., \"template\": ...}}", path);
      }
      sources.emplace_back(entry["name"].get<std::string>(), entry["template"].get<std::string>());
    }
  } else {
    return invalid_argument("{}: chat_template must be a string or a list of named templates", path);
  }
  for (const auto& [name, source] : sources) {
    template_sources_.push_back(source);
    auto compiled = ChatTemplate::compile(source, special_tokens_);
    if (!compiled.ok()) {
      // The tokenizer still serves completions; chat requests get this error.
      template_error_ = compiled.status().with_context(fmt::format("{} (template '{}')", path, name));
      templates_.clear();
      return {};
    }
    templates_[name] = *compiled;
  }
  return {};
}

Status Tokenizer::load_generation_config(const std::string& path) {
  MOELORA_ASSIGN_OR_RETURN(auto text, read_text_file(path));
  MOELORA_ASSIGN_OR_RETURN(Json config, parse_json_strict(text, path));
  const auto it = config.find("eos_token_id");
  if (it == config.end() || it->is_null()) return {};
  std::vector<Json> ids = it->is_array() ? std::vector<Json>(it->begin(), it->end()) : std::vector<Json>{*it};
  for (const Json& id : ids) {
    if (!id.is_number_integer()) return invalid_argument("{}: eos_token_id must be an integer or a list of integers", path);
    const auto v = id.get<int32_t>();
    if (std::find(eos_ids_.begin(), eos_ids_.end(), v) == eos_ids_.end()) eos_ids_.push_back(v);
  }
  return {};
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return bpe_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return bpe_->decode(ids, skip_special_tokens);
}

Status Tokenizer::validate_ids(std::span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!bpe_->is_valid_id(ids[i])) {
      return invalid_argument("token id {} (at position {}) is not in the vocabulary of {} ids", ids[i], i,
                              bpe_->vocab_size());
    }
  }
  return {};
}

Result<std::string> Tokenizer::apply_chat_template(const nlohmann::ordered_json& messages,
                                                   const ChatTemplateArgs& args) const {
  if (!template_error_.ok()) return template_error_;
  if (templates_.empty()) {
    return make_error(ErrorCode::kFailedPrecondition,
                      "{}: the tokenizer has no chat template (tokenizer_config.json has no chat_template)", dir_);
  }
  std::string name = args.template_name;
  if (name.empty()) {
    name = !args.tools.is_null() && templates_.count("tool_use") ? "tool_use" : "default";
    if (!templates_.count(name) && templates_.size() == 1) name = templates_.begin()->first;
  }
  const auto it = templates_.find(name);
  if (it == templates_.end()) return invalid_argument("{}: there is no chat template named '{}'", dir_, name);
  return it->second->render(messages, args);
}

Result<std::string> Tokenizer::apply_chat_template(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                   const nlohmann::ordered_json& tools,
                                                   const nlohmann::ordered_json& extra) const {
  ChatTemplateArgs args;
  args.add_generation_prompt = add_generation_prompt;
  args.tools = tools;
  args.extra = extra;
  return apply_chat_template(messages, args);
}

Result<std::vector<int32_t>> Tokenizer::encode_chat(const nlohmann::ordered_json& messages,
                                                    const ChatTemplateArgs& args) const {
  MOELORA_ASSIGN_OR_RETURN(auto text, apply_chat_template(messages, args));
  return encode(text, false);
}

}  // namespace moelora
