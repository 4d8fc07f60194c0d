// libFuzzer target: client text through the real tokenizers (FUZZ_TOKENIZER_DIRS, colon-separated
// tokenizer folders) and client messages through their chat templates. No crash or hang, and the
// streaming decoder's contract holds: every chunk is valid UTF-8 and the chunks add up to decode().
// Inputs starting with 0xff are chat templates themselves (compiled and rendered within limits).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer_dir.h"
#include "tokenizer/utf8.h"

namespace {

const std::vector<std::shared_ptr<moelora::Tokenizer>>& tokenizers() {
  static const auto all = [] {
    std::vector<std::shared_ptr<moelora::Tokenizer>> out;
    const char* env = std::getenv("FUZZ_TOKENIZER_DIRS");
    std::stringstream dirs(env ? env : "");
    for (std::string dir; std::getline(dirs, dir, ':');) {
      if (dir.empty()) continue;
      auto t = moelora::Tokenizer::load(dir);
      if (!t.ok()) std::abort();  // the harness was given a folder that is not a tokenizer
      out.push_back(*t);
    }
    if (out.empty()) std::abort();
    return out;
  }();
  return all;
}

void check_stream(const moelora::Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  auto dec = tok.stream_decoder(skip);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string chunk = dec.push(id);
    if (!moelora::utf8::is_valid(chunk)) std::abort();
    streamed += chunk;
  }
  const std::string last = dec.finish();
  if (!moelora::utf8::is_valid(last)) std::abort();
  streamed += last;
  if (streamed != tok.decode(ids, skip)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& toks = tokenizers();
  if (size < 2) return 0;
  if (data[0] == 0xff) {
    // The input as a chat template itself (tokenizer_config.json comes with a model folder): it
    // compiles or is refused, and renders within the interpreter's limits or fails cleanly.
    const std::string source(reinterpret_cast<const char*>(data) + 2, size - 2);
    auto tpl = moelora::JinjaTemplate::compile(source);
    if (!tpl.ok()) return 0;
    nlohmann::ordered_json vars = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                   {"add_generation_prompt", (data[1] & 1) != 0},
                                   {"bos_token", "<s>"},
                                   {"tools", nullptr}};
    moelora::jinja::RenderLimits limits;
    limits.max_output_bytes = 1 << 20;
    limits.max_range = 1 << 12;
    (void)(*tpl)->render(vars, limits);
    return 0;
  }
  const moelora::Tokenizer& tok = *toks[data[0] % toks.size()];
  const uint8_t mode = data[1];
  const std::string text(reinterpret_cast<const char*>(data) + 2, size - 2);

  // Any bytes as a prompt (the server refuses invalid UTF-8 earlier, the tokenizer must not care).
  const std::vector<int32_t> ids = tok.encode(text, (mode & 1) != 0);
  if (!tok.validate_ids(ids).ok()) std::abort();
  check_stream(tok, ids, (mode & 2) != 0);

  // The input's bytes as token ids (what a client sends as a prompt of ids), through the decoders.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 1 < text.size(); i += 2)
    raw.push_back(static_cast<int32_t>(static_cast<uint8_t>(text[i]) | (static_cast<uint8_t>(text[i + 1]) << 8)));
  if (tok.validate_ids(raw).ok()) check_stream(tok, raw, (mode & 4) != 0);

  // Messages as a client sends them (valid UTF-8, as JSON bodies are), through the chat template.
  if (tok.has_chat_template() && moelora::utf8::is_valid(text)) {
    static const char* roles[] = {"system", "user", "assistant", "tool", "user"};
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    size_t start = 0;
    int i = 0;
    for (size_t pos = 0; pos <= text.size(); ++pos) {
      if (pos < text.size() && text[pos] != '\n') continue;
      nlohmann::ordered_json m = {{"role", roles[((mode >> 3) + i++) % 5]}, {"content", text.substr(start, pos - start)}};
      if (m["role"] == "assistant" && (mode & 0x40))
        m["tool_calls"] = nlohmann::ordered_json::array(
            {{{"id", "call_1"}, {"type", "function"},
              {"function", {{"name", text.substr(start, (pos - start) / 2)}, {"arguments", "{\"x\": 1}"}}}}});
      messages.push_back(std::move(m));
      start = pos + 1;
    }
    nlohmann::ordered_json tools = nullptr;
    if (mode & 0x80)
      tools = nlohmann::ordered_json::array(
          {{{"type", "function"},
            {"function", {{"name", "f"}, {"description", text.substr(0, 40)}, {"parameters", {{"type", "object"}}}}}}});
    (void)tok.apply_chat_template(messages, (mode & 0x20) != 0, tools);
  }
  return 0;
}
