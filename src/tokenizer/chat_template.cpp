#include "tokenizer/chat_template.h"

#include "tokenizer/jinja_parser.h"
#include "tokenizer/utf8.h"

namespace moelora {
namespace {

Status to_status(const std::string& name, const jinja::Error& e) {
  if (e.line > 0) return invalid_argument("{} line {}: {}", name, e.line, e.message);
  return invalid_argument("{}: {}", name, e.message);
}

}  // namespace

Result<std::shared_ptr<const JinjaTemplate>> JinjaTemplate::compile(std::string_view source, std::string name) {
  if (!utf8::is_valid(source)) return invalid_argument("{}: the template is not valid UTF-8", name);
  std::shared_ptr<JinjaTemplate> t(new JinjaTemplate());
  t->name_ = std::move(name);
  try {
    t->body_ = jinja::parse(source);
  } catch (const jinja::Error& e) {
    return to_status(t->name_, e);
  }
  return std::shared_ptr<const JinjaTemplate>(std::move(t));
}

Result<std::string> JinjaTemplate::render(const jinja::Value& variables, const jinja::RenderLimits& limits) const {
  if (!variables.is_mapping()) return invalid_argument("{}: template variables must be a mapping", name_);
  try {
    jinja::Interpreter interpreter(variables, limits);
    return interpreter.render(body_);
  } catch (const jinja::Error& e) {
    return to_status(name_, e);
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kResourceExhausted, "{}: out of memory while rendering", name_);
  }
}

Result<std::string> JinjaTemplate::render(const nlohmann::ordered_json& variables,
                                          const jinja::RenderLimits& limits) const {
  if (!variables.is_object()) return invalid_argument("{}: template variables must be a JSON object", name_);
  return render(jinja::from_json(variables), limits);
}

Result<std::shared_ptr<const ChatTemplate>> ChatTemplate::compile(std::string_view source,
                                                                  nlohmann::ordered_json special_tokens) {
  if (!special_tokens.is_object()) return invalid_argument("chat template: special tokens must be a JSON object");
  MOELORA_ASSIGN_OR_RETURN(auto compiled, JinjaTemplate::compile(source, "chat template"));
  std::shared_ptr<ChatTemplate> t(new ChatTemplate());
  t->source_ = std::string(source);
  t->template_ = std::move(compiled);
  t->special_tokens_ = std::move(special_tokens);
  return std::shared_ptr<const ChatTemplate>(std::move(t));
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatTemplateArgs& args) const {
  if (!messages.is_array()) return invalid_argument("chat template: messages must be a list");
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object()) return invalid_argument("chat template: messages[{}] must be an object", i);
  }
  if (!args.tools.is_null() && !args.tools.is_array()) return invalid_argument("chat template: tools must be a list");
  if (!args.extra.is_null() && !args.extra.is_object()) {
    return invalid_argument("chat template: extra template variables must be an object");
  }
  // What transformers passes: the special tokens, the caller's kwargs, then the fixed names.
  nlohmann::ordered_json variables = special_tokens_;
  if (args.extra.is_object()) {
    for (const auto& [key, value] : args.extra.items()) {
      if (key == "messages" || key == "tools" || key == "documents" || key == "add_generation_prompt") {
        return invalid_argument("chat template: '{}' cannot be passed as an extra template variable", key);
      }
      variables[key] = value;
    }
  }
  variables["messages"] = messages;
  variables["tools"] = args.tools;
  variables["documents"] = args.documents;
  variables["add_generation_prompt"] = args.add_generation_prompt;
  return template_->render(variables);
}

}  // namespace moelora
