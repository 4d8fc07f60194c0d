// OpenAI-compatible response objects: completions and chat completions, whole or as SSE chunks,
// usage and logprobs. Pure formatting: no engine, no HTTP.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/api_error.h"
#include "runtime/engine.h"

namespace moelora::server {

enum class ApiKind { kCompletion, kChat };

// The identity every object and chunk of one response repeats.
struct ResponseHeader {
  ApiKind kind = ApiKind::kCompletion;
  std::string id;     // cmpl-... or chatcmpl-...
  std::string model;  // the model name as the client sent it
  int64_t created = 0;
};

struct UsageCounts {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;
};
OJson usage_json(const UsageCounts& u);

// Logprobs of the tokens of one choice, in the endpoint's format: completions
// {tokens, token_logprobs, top_logprobs, text_offset}; chat {content: [{token, logprob, bytes,
// top_logprobs}]}. Token strings are the tokens' bytes (invalid UTF-8 becomes U+FFFD in JSON).
class LogprobsBuilder {
 public:
  explicit LogprobsBuilder(ApiKind kind) : kind_(kind) {}
  void add(const std::string& token_text, float logprob,
           const std::vector<std::pair<std::string, float>>& top, int text_offset);
  bool empty() const { return count_ == 0; }
  OJson take();  // the object so far; the builder starts over

 private:
  ApiKind kind_;
  int count_ = 0;
  OJson tokens_ = OJson::array(), token_logprobs_ = OJson::array(), top_ = OJson::array(), offsets_ = OJson::array();
  OJson content_ = OJson::array();
};

// One choice's part of a chunk or of a whole response.
struct ChoiceOutput {
  int index = 0;
  std::string text;                     // delta (chunk) or whole text (response)
  bool role = false;                    // chat chunk: carry {"role": "assistant"}
  std::optional<OJson> logprobs;
  std::optional<std::string> finish_reason;
  OJson stop_reason;                     // null, a stop string or a stop token id
  std::optional<std::vector<int32_t>> token_ids;
  std::optional<std::vector<int32_t>> prompt_token_ids;
  // Chat: parsed tool calls (tool_calls.h). A chunk carries delta objects, a response the
  // whole calls; with calls, an empty content is null in a response.
  std::optional<OJson> tool_calls;
};

// A streamed chunk with these choices (usage: null, or the counts when continuous).
OJson chunk_json(const ResponseHeader& h, const std::vector<ChoiceOutput>& choices, const std::optional<OJson>& usage);
// The last chunk when stream_options.include_usage: no choices, the usage.
OJson usage_chunk_json(const ResponseHeader& h, const UsageCounts& u);
// A whole (non-streamed) response.
OJson response_json(const ResponseHeader& h, const std::vector<ChoiceOutput>& choices, const UsageCounts& u);

const char* object_name(ApiKind kind, bool chunk);

}  // namespace moelora::server
