// Text in and out for the server: the model folder's tokenizer.json (encode, decode, streaming
// decode that never splits a UTF-8 character) and its chat template from tokenizer_config.json.
// A model folder without tokenizer.json is served too: prompts must then be token ids and
// responses carry token ids (return_token_ids) with empty text.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "server/openai_protocol.h"
#include "server/tool_calls.h"

namespace moelora {
class BpeTokenizer;
class StreamDecoder;
class Tokenizer;
}  // namespace moelora

namespace moelora::server {

class ServingTokenizer {
 public:
  // Never fails for a folder without tokenizer.json; fails for a broken one.
  static Result<std::shared_ptr<ServingTokenizer>> load(const std::string& model_dir);

  bool has_tokenizer() const { return tok_ != nullptr; }
  bool has_chat_template() const;
  // Ids that end generation besides the model's own (tokenizer_config.json's eos_token, e.g.
  // <|im_end|> of a chat model).
  const std::vector<int32_t>& eos_token_ids() const;

  Result<std::vector<int32_t>> encode(std::string_view text, bool add_special_tokens) const;
  // The prompt of a chat: the template rendered, then encoded without adding special tokens
  // again (the template writes them).
  // `tools`: the request's tool definitions (null: none), given to the template.
  Result<std::vector<int32_t>> encode_chat(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                           bool continue_final_message, const OJson& tools = nullptr) const;
  // How this model writes tool calls (kNone: unknown, tool calls are not parsed).
  ToolCallFormat tool_call_format() const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  // A fresh incremental decoder for one streamed choice (null without a tokenizer).
  std::unique_ptr<StreamDecoder> stream_decoder(bool skip_special_tokens) const;
  // What one token contributes to the text, as raw bytes (may be part of a character), for
  // logprobs and /tokenize's token_strs.
  std::string token_bytes(int32_t id) const;
  bool is_valid_id(int32_t id) const;

 private:
  std::shared_ptr<Tokenizer> tok_;  // null: the model folder has no tokenizer.json
};

}  // namespace moelora::server
