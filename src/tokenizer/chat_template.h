// Chat templates: the Jinja template of tokenizer_config.json rendered the way Hugging Face
// transformers' apply_chat_template renders it (Jinja2 sandbox with trim_blocks, lstrip_blocks,
// loop controls, its own tojson, raise_exception and strftime_now), so that the prompt text is
// the one the model was trained on. See jinja_parser.h for the Jinja subset covered; anything
// outside it fails at compile time with the construct and its line.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_interpreter.h"

namespace moelora {

// A compiled Jinja template (any template, not only chat ones).
class JinjaTemplate {
 public:
  // `name` prefixes error messages ("chat template").
  static Result<std::shared_ptr<const JinjaTemplate>> compile(std::string_view source, std::string name = "template");
  // `variables` must be a JSON object; keys become template variables (key order is kept).
  Result<std::string> render(const nlohmann::ordered_json& variables, const jinja::RenderLimits& limits = {}) const;
  Result<std::string> render(const jinja::Value& variables, const jinja::RenderLimits& limits = {}) const;

 private:
  JinjaTemplate() = default;
  std::string name_;
  jinja::Body body_;
};

struct ChatTemplateArgs {
  bool add_generation_prompt = false;
  nlohmann::ordered_json tools = nullptr;      // a list of tool schemas, or null
  nlohmann::ordered_json documents = nullptr;  // a list of documents (RAG templates), or null
  // Further variables: chat_template_kwargs such as {"enable_thinking": false}. They may not
  // replace messages, tools, documents or add_generation_prompt.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  // For a tokenizer with several named templates: which one ("tool_use"...). Empty: "tool_use"
  // when tools are given and it exists, else "default" (transformers' choice).
  std::string template_name;
};

class ChatTemplate {
 public:
  // `special_tokens` is a JSON object of variables every render gets: bos_token, eos_token,
  // pad_token, unk_token... as transformers passes its special_tokens_map.
  static Result<std::shared_ptr<const ChatTemplate>> compile(std::string_view source,
                                                             nlohmann::ordered_json special_tokens);

  // `messages`: the conversation, a list of {"role", "content", ...} objects. Pass an
  // ordered_json (nlohmann::ordered_json::parse) to keep the client's key order in tojson output.
  Result<std::string> render(const nlohmann::ordered_json& messages, const ChatTemplateArgs& args = {}) const;

  const std::string& source() const { return source_; }

 private:
  ChatTemplate() = default;
  std::string source_;
  std::shared_ptr<const JinjaTemplate> template_;
  nlohmann::ordered_json special_tokens_;
};

}  // namespace moelora
