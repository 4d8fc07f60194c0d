#include "server/openai_responses.h"

#include <cmath>

namespace moelora::server {

namespace {
// JSON has no infinities; vLLM reports impossible tokens with this floor.
double finite_logprob(float lp) { return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0; }

OJson bytes_of(const std::string& s) {
  OJson b = OJson::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}
}  // namespace

const char* object_name(ApiKind kind, bool chunk) {
  if (kind == ApiKind::kChat) return chunk ? "chat.completion.chunk" : "chat.completion";
  return "text_completion";
}

OJson usage_json(const UsageCounts& u) {
  return OJson{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

void LogprobsBuilder::add(const std::string& token_text, float logprob,
                          const std::vector<std::pair<std::string, float>>& top, int text_offset) {
  ++count_;
  if (kind_ == ApiKind::kCompletion) {
    tokens_.push_back(token_text);
    token_logprobs_.push_back(finite_logprob(logprob));
    OJson alts = OJson::object();
    for (const auto& [t, lp] : top) alts[t] = finite_logprob(lp);
    top_.push_back(std::move(alts));
    offsets_.push_back(text_offset);
    return;
  }
  OJson alts = OJson::array();
  for (const auto& [t, lp] : top) alts.push_back({{"token", t}, {"logprob", finite_logprob(lp)}, {"bytes", bytes_of(t)}});
  content_.push_back({{"token", token_text},
                      {"logprob", finite_logprob(logprob)},
                      {"bytes", bytes_of(token_text)},
                      {"top_logprobs", std::move(alts)}});
}

OJson LogprobsBuilder::take() {
  OJson out;
  if (kind_ == ApiKind::kCompletion) {
    out = {{"tokens", std::move(tokens_)},
           {"token_logprobs", std::move(token_logprobs_)},
           {"top_logprobs", std::move(top_)},
           {"text_offset", std::move(offsets_)}};
  } else {
    out = {{"content", std::move(content_)}};
  }
  *this = LogprobsBuilder(kind_);
  return out;
}

namespace {

OJson choice_json(ApiKind kind, const ChoiceOutput& c, bool chunk) {
  OJson j = {{"index", c.index}};
  if (kind == ApiKind::kCompletion) {
    j["text"] = c.text;
  } else if (chunk) {
    OJson delta = OJson::object();
    if (c.role) delta["role"] = "assistant";
    if (!c.text.empty() || c.role) delta["content"] = c.text;
    if (c.tool_calls && !c.tool_calls->empty()) delta["tool_calls"] = *c.tool_calls;
    j["delta"] = std::move(delta);
  } else {
    j["message"] = {{"role", "assistant"}, {"content", c.text}};
    if (c.tool_calls && !c.tool_calls->empty()) {
      if (c.text.empty()) j["message"]["content"] = nullptr;  // as OpenAI answers a pure tool call
      j["message"]["tool_calls"] = *c.tool_calls;
    }
  }
  j["logprobs"] = c.logprobs ? *c.logprobs : OJson(nullptr);
  j["finish_reason"] = c.finish_reason ? OJson(*c.finish_reason) : OJson(nullptr);
  j["stop_reason"] = c.stop_reason;
  if (c.token_ids) j["token_ids"] = *c.token_ids;
  if (c.prompt_token_ids) j["prompt_token_ids"] = *c.prompt_token_ids;
  return j;
}

OJson header_json(const ResponseHeader& h, bool chunk) {
  return OJson{{"id", h.id}, {"object", object_name(h.kind, chunk)}, {"created", h.created}, {"model", h.model}};
}

}  // namespace

OJson chunk_json(const ResponseHeader& h, const std::vector<ChoiceOutput>& choices, const std::optional<OJson>& usage) {
  OJson j = header_json(h, true);
  OJson arr = OJson::array();
  for (const ChoiceOutput& c : choices) arr.push_back(choice_json(h.kind, c, true));
  j["choices"] = std::move(arr);
  if (usage) j["usage"] = *usage;
  return j;
}

OJson usage_chunk_json(const ResponseHeader& h, const UsageCounts& u) {
  OJson j = header_json(h, true);
  j["choices"] = OJson::array();
  j["usage"] = usage_json(u);
  return j;
}

OJson response_json(const ResponseHeader& h, const std::vector<ChoiceOutput>& choices, const UsageCounts& u) {
  OJson j = header_json(h, false);
  OJson arr = OJson::array();
  for (const ChoiceOutput& c : choices) arr.push_back(choice_json(h.kind, c, false));
  j["choices"] = std::move(arr);
  j["usage"] = usage_json(u);
  return j;
}

}  // namespace moelora::server
