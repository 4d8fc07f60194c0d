// A model's tokenizer as a directory holds it: tokenizer.json (required), tokenizer_config.json
// (chat template, bos/eos tokens, add_bos_token...), and optionally chat_template.jinja and
// generation_config.json (more end-of-sequence ids). This is what the server and the CLI use.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/stream_decoder.h"

namespace moelora {

struct TokenizerOptions {
  TokenizerCompat compat = TokenizerCompat::kHuggingFace;
};

class Tokenizer {
 public:
  static Result<std::shared_ptr<Tokenizer>> load(const std::string& dir, const TokenizerOptions& options = {});

  // add_special_tokens: the tokens the model wants around a plain prompt (DeepSeek-V3's BOS);
  // what vLLM's /tokenize and /v1/completions do by default. Chat prompts already hold them.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // continues_text: the ids follow a prompt (see StreamDecoder), so no start-of-text rule applies.
  StreamDecoder stream_decoder(bool skip_special_tokens = true, bool continues_text = false) const {
    return StreamDecoder(bpe_, skip_special_tokens, continues_text);
  }
  // kInvalidArgument naming the first id that is not in the vocabulary.
  Status validate_ids(std::span<const int32_t> ids) const;

  bool has_chat_template() const { return !templates_.empty() || !template_error_.ok(); }
  // Whether a chat template's source contains `text` (how the server recognises a model's
  // tool-call format when its markers are not tokens).
  bool chat_template_mentions(std::string_view text) const {
    for (const auto& s : template_sources_)
      if (s.find(text) != std::string::npos) return true;
    return false;
  }
  // The prompt text for a conversation (see ChatTemplateArgs).
  Result<std::string> apply_chat_template(const nlohmann::ordered_json& messages, const ChatTemplateArgs& args = {}) const;
  Result<std::string> apply_chat_template(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                          const nlohmann::ordered_json& tools = nullptr,
                                          const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
  // Renders and tokenizes without adding special tokens (the template writes them), as
  // transformers' apply_chat_template(tokenize=True) does.
  Result<std::vector<int32_t>> encode_chat(const nlohmann::ordered_json& messages, const ChatTemplateArgs& args = {}) const;

  std::optional<int32_t> token_to_id(std::string_view token) const { return bpe_->token_to_id(token); }
  std::optional<std::string> id_to_token(int32_t id) const { return bpe_->id_to_token(id); }
  bool is_special(int32_t id) const { return bpe_->is_special(id); }
  int32_t vocab_size() const { return bpe_->vocab_size(); }

  const std::optional<std::string>& bos_token() const { return bos_token_; }
  const std::optional<std::string>& eos_token() const { return eos_token_; }
  std::optional<int32_t> bos_token_id() const { return bos_id_; }
  std::optional<int32_t> eos_token_id() const { return eos_id_; }
  // Every id that ends generation: the eos token and generation_config.json's eos_token_id(s).
  const std::vector<int32_t>& eos_token_ids() const { return eos_ids_; }

  const BpeTokenizer& bpe() const { return *bpe_; }
  std::shared_ptr<const BpeTokenizer> bpe_ptr() const { return bpe_; }
  const std::string& dir() const { return dir_; }

 private:
  Tokenizer() = default;
  Status load_config(const std::string& path);
  Status load_generation_config(const std::string& path);

  std::string dir_;
  std::shared_ptr<BpeTokenizer> bpe_;
  std::optional<std::string> bos_token_, eos_token_;
  std::optional<int32_t> bos_id_, eos_id_;
  std::vector<int32_t> eos_ids_;
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();  // what templates see
  std::map<std::string, std::shared_ptr<const ChatTemplate>> templates_;       // by name; "default"
  Status template_error_;  // why the chat template could not be compiled, if it could not
  std::vector<std::string> template_sources_;
};

}  // namespace moelora
