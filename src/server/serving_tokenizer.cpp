#include "server/serving_tokenizer.h"

#include <filesystem>

#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer_dir.h"

namespace moelora::server {

namespace fs = std::filesystem;

Result<std::shared_ptr<ServingTokenizer>> ServingTokenizer::load(const std::string& model_dir) {
  auto t = std::make_shared<ServingTokenizer>();
  std::error_code ec;
  if (!fs::exists(fs::path(model_dir) / "tokenizer.json", ec)) return t;
  MOELORA_ASSIGN_OR_RETURN(t->tok_, Tokenizer::load(model_dir));
  return t;
}

bool ServingTokenizer::has_chat_template() const { return tok_ && tok_->has_chat_template(); }

const std::vector<int32_t>& ServingTokenizer::eos_token_ids() const {
  static const std::vector<int32_t> none;
  return tok_ ? tok_->eos_token_ids() : none;
}

Result<std::vector<int32_t>> ServingTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (!tok_) return invalid_argument("this model has no tokenizer.json: send the prompt as token ids");
  return tok_->encode(text, add_special_tokens);
}

Result<std::vector<int32_t>> ServingTokenizer::encode_chat(const std::vector<ChatMessage>& messages,
                                                           bool add_generation_prompt, bool continue_final_message,
                                                           const OJson& tools) const {
  if (!tok_) return invalid_argument("chat completions need the model's tokenizer.json, which this model lacks");
  if (!tok_->has_chat_template())
    return invalid_argument("this model has no chat template (tokenizer_config.json chat_template); "
                            "use /v1/completions");
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) {
    nlohmann::ordered_json msg = {{"role", m.role}, {"content", m.content}};
    for (const auto& [key, value] : m.tool_fields.items()) msg[key] = value;
    msgs.push_back(std::move(msg));
  }
  ChatTemplateArgs args;
  args.tools = tools;
  args.add_generation_prompt = add_generation_prompt && !continue_final_message;
  MOELORA_ASSIGN_OR_RETURN(std::string text, tok_->apply_chat_template(msgs, args));
  if (continue_final_message) {
    // As transformers does: cut the rendering right after the final message's content, so the
    // model continues that message instead of starting a new turn.
    const std::string& last = messages.back().content;
    const size_t at = last.empty() ? std::string::npos : text.rfind(last);
    if (at == std::string::npos)
      return invalid_argument("continue_final_message: the final message's content is not in the rendered prompt");
    text.resize(at + last.size());
  }
  return tok_->encode(text, /*add_special_tokens=*/false);
}

ToolCallFormat ServingTokenizer::tool_call_format() const {
  if (!tok_) return ToolCallFormat::kNone;
  return detect_tool_call_format([this](std::string_view t) { return tok_->token_to_id(t).has_value(); },
                                 [this](std::string_view t) { return tok_->chat_template_mentions(t); });
}

std::string ServingTokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return tok_ ? tok_->decode(ids, skip_special_tokens) : std::string();
}

std::unique_ptr<StreamDecoder> ServingTokenizer::stream_decoder(bool skip_special_tokens) const {
  if (!tok_) return nullptr;
  // Generated text continues the prompt: a SentencePiece tokenizer must keep the space of the
  // first generated word (" Paris" after "The capital is"), as vLLM does.
  return std::make_unique<StreamDecoder>(tok_->bpe_ptr(), skip_special_tokens, /*continues_text=*/true);
}

std::string ServingTokenizer::token_bytes(int32_t id) const {
  if (!tok_) return std::string();
  return std::string(tok_->bpe().piece(id).text);
}

bool ServingTokenizer::is_valid_id(int32_t id) const { return tok_ && tok_->bpe().is_valid_id(id); }

}  // namespace moelora::server
