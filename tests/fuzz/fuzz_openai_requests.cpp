// libFuzzer target: request bodies as the OpenAI endpoints parse them (the bytes come from any
// client on the network). Errors are answers (ApiError); crashes, UB, leaks and hangs are not.
// A request that parses satisfies the limits it was parsed under.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/openai_protocol.h"

namespace ms = moelora::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  moelora::Json json;
  if (ms::parse_json_body(body, &json)) return 0;
  ms::ProtocolLimits limits;
  limits.vocab_size = 1000;

  ms::ChatCompletionRequest chat;
  if (!ms::parse_chat_completion_request(json, limits, &chat)) {
    if (chat.opts.n < 1 || chat.opts.n > limits.max_n) std::abort();
    if (static_cast<int>(chat.opts.stop.size()) > limits.max_stop_strings) std::abort();
    ms::keep_client_key_order(body, &chat.messages, &chat.tools);
  }
  ms::CompletionRequest completion;
  if (!ms::parse_completion_request(json, limits, &completion)) {
    if (completion.prompts.empty() || static_cast<int>(completion.prompts.size()) > limits.max_prompts) std::abort();
    if (static_cast<int>(completion.prompts.size()) * completion.opts.n > limits.max_choices) std::abort();
    for (const auto& p : completion.prompts)
      for (int32_t id : p.ids)
        if (id < 0 || id >= limits.vocab_size) std::abort();
  }
  std::vector<ms::ChatMessage> messages;
  if (auto m = json.find("messages"); m != json.end()) (void)ms::parse_chat_messages(*m, &messages);
  return 0;
}
