// `moelora tokenize`: the tokenizer layer from the command line, one JSON value per input line
// and one JSON line out per input line (so it composes with jq and scripts):
//
//   echo '"Hello, world!"' | moelora tokenize --tokenizer DIR          -> {"ids": [...]}
//   echo '[{"role": "user", "content": "Hi"}]' | moelora tokenize --tokenizer DIR --chat
//                                                                      -> {"text": "...", "ids": [...]}
//   echo '[9707, 11, 1879]' | moelora tokenize --tokenizer DIR --decode -> {"text": "..."}
//
// With --chat a line may also be an object: {"messages": [...], "tools": [...],
// "add_generation_prompt": true, "chat_template_kwargs": {...}}. A line that is not acceptable
// gets {"error": "..."} and the next line is read; the exit code is then 1.
#include <cstdio>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/log.h"
#include "tokenizer/tokenizer_dir.h"
#include "tools/commands.h"

namespace moelora::tools {
namespace {

using ordered_json = nlohmann::ordered_json;

struct TokenizeArgs {
  std::string tokenizer_dir;
  bool chat = false;
  bool decode = false;
  bool no_special_tokens = false;
  bool skip_special_tokens = false;
  bool no_generation_prompt = false;
  std::string compat = "hf";
};

// One input line -> the JSON object to print, or an error message.
Result<ordered_json> handle_line(const Tokenizer& tok, const TokenizeArgs& a, const std::string& line) {
  ordered_json input;
  try {
    input = ordered_json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("the line is not valid JSON: {}", e.what());
  }
  if (a.decode) {
    if (!input.is_array()) return invalid_argument("--decode expects a JSON array of token ids");
    std::vector<int32_t> ids;
    for (const auto& id : input) {
      if (!id.is_number_integer() || id.get<int64_t>() < INT32_MIN || id.get<int64_t>() > INT32_MAX) {
        return invalid_argument("token ids must be integers, got {}", id.dump());
      }
      ids.push_back(id.get<int32_t>());
    }
    MOELORA_RETURN_IF_ERROR(tok.validate_ids(ids));
    return ordered_json{{"text", tok.decode(ids, a.skip_special_tokens)}};
  }
  if (a.chat) {
    ChatTemplateArgs args;
    args.add_generation_prompt = !a.no_generation_prompt;
    ordered_json messages;
    if (input.is_array()) {
      messages = input;
    } else if (input.is_object() && input.contains("messages")) {
      messages = input["messages"];
      if (input.contains("tools")) args.tools = input["tools"];
      if (input.contains("documents")) args.documents = input["documents"];
      if (input.contains("add_generation_prompt")) {
        if (!input["add_generation_prompt"].is_boolean()) return invalid_argument("add_generation_prompt must be true or false");
        args.add_generation_prompt = input["add_generation_prompt"].get<bool>();
      }
      if (input.contains("chat_template_kwargs")) args.extra = input["chat_template_kwargs"];
    } else {
      return invalid_argument("--chat expects a message list or an object with \"messages\"");
    }
    MOELORA_ASSIGN_OR_RETURN(auto text, tok.apply_chat_template(messages, args));
    std::vector<int32_t> ids = tok.encode(text, /*add_special_tokens=*/false);
    return ordered_json{{"text", text}, {"ids", ids}};
  }
  if (!input.is_string()) return invalid_argument("expected a JSON string (use --chat for message lists)");
  return ordered_json{{"ids", tok.encode(input.get<std::string>(), !a.no_special_tokens)}};
}

int run_tokenize(const TokenizeArgs& a) {
  const std::string dir = a.tokenizer_dir.empty() ? default_model_dir() : a.tokenizer_dir;
  if (dir.empty()) {
    std::fprintf(stderr, "moelora tokenize: no --tokenizer given and the bundled model was not found\n");
    return 2;
  }
  TokenizerOptions options;
  if (a.compat == "js") options.compat = TokenizerCompat::kTransformersJs;
  auto tok = Tokenizer::load(dir, options);
  if (!tok.ok()) {
    std::fprintf(stderr, "moelora tokenize: %s\n", tok.status().to_string().c_str());
    return 2;
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  bool any_error = false;
  while (std::getline(std::cin, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    auto out = handle_line(**tok, a, line);
    if (!out.ok()) any_error = true;
    const ordered_json j = out.ok() ? *out : ordered_json{{"error", out.status().message()}};
    // Replace rather than throw if text ever held invalid UTF-8 (decode output never does).
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n' << std::flush;
  }
  return any_error ? 1 : 0;
}

}  // namespace

void register_tokenize(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<TokenizeArgs>();
  auto* cmd = app.add_subcommand("tokenize", "Tokenize JSON lines from stdin: strings to ids, --chat message lists to "
                                             "prompt text and ids, --decode id lists to text");
  cmd->add_option("--tokenizer", args->tokenizer_dir,
                  "Directory with tokenizer.json and tokenizer_config.json (default: the bundled model)");
  cmd->add_flag("--chat", args->chat, "Lines are message lists (or {\"messages\", \"tools\", ...}): render the chat template");
  cmd->add_flag("--decode", args->decode, "Lines are arrays of token ids: print the text");
  cmd->add_flag("--no-special-tokens", args->no_special_tokens,
                "Do not add the model's special tokens (e.g. a BOS) around plain strings");
  cmd->add_flag("--skip-special-tokens", args->skip_special_tokens, "With --decode: leave special tokens out of the text");
  cmd->add_flag("--no-generation-prompt", args->no_generation_prompt,
                "With --chat: do not end the prompt with the assistant's turn header");
  cmd->add_option("--compat", args->compat,
                  "Where Hugging Face's libraries differ, reproduce 'hf' (Rust tokenizers, default) or 'js' "
                  "(transformers.js)")
      ->check(CLI::IsMember({"hf", "js"}));
  cmd->callback([args, &exit_code] {
    if (args->chat && args->decode) {
      std::fprintf(stderr, "moelora tokenize: --chat and --decode are exclusive\n");
      exit_code = 2;
      return;
    }
    exit_code = run_tokenize(*args);
  });
}

}  // namespace moelora::tools
