// OpenAI-compatible request parsing: JSON bodies of /v1/completions and /v1/chat/completions
// become native structs, every field checked for type and range with an error that names it
// (vLLM's conventions, its extensions included: top_k, min_p, stop_token_ids, ignore_eos,
// include_stop_str_in_output, skip_special_tokens, return_token_ids; sglang's lora_path).
// Unknown fields are ignored, as vLLM does; every field vLLM documents is either honoured or
// refused with a 400 that names it (best_of != n, beam search, guided decoding, prompt logprobs...),
// never silently dropped.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json_util.h"
#include "runtime/engine.h"
#include "server/api_error.h"

namespace moelora::server {

struct ChatMessage {
  std::string role;     // system, user, assistant, tool, developer
  std::string content;  // text parts joined
  // Tool-calling fields, passed to the chat template as sent: an assistant's "tool_calls", a
  // tool result's "tool_call_id" and "name".
  OJson tool_fields = OJson::object();
};

// A prompt as given: text, or token ids.
struct PromptInput {
  bool is_ids = false;
  std::string text;
  std::vector<int32_t> ids;
};

// Fields shared by completions and chat completions.
struct GenerationOptions {
  std::string model;                     // as sent ("" = absent: the base model)
  std::optional<std::string> lora_path;  // sglang: the adapter's name
  SamplingParams sampling;               // max_tokens resolved by the server when not given
  bool max_tokens_given = false;
  int n = 1;
  bool stream = false;
  bool include_usage = false;            // stream_options.include_usage
  bool continuous_usage_stats = false;   // stream_options.continuous_usage_stats (vLLM)
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool return_token_ids = false;
  bool want_logprobs = false;            // report the chosen token's logprob
  int top_logprobs = 0;                  // alternatives per token
  // vLLM's bad_words as sent; the server tokenizes them into sampling.bad_words
  // (tokenize_bad_words) because the parser has no tokenizer.
  std::vector<std::string> bad_words;
  std::optional<bool> add_special_tokens;       // default: true for completions, false for chat
  std::optional<int> truncate_prompt_tokens;    // keep only the last k prompt tokens (-1: max_model_len)
  std::string cache_salt;                       // vLLM: prefix-cache entries are shared only under the same salt
  std::optional<std::string> request_id;        // vLLM: the response id's suffix (X-Request-Id wins)
};

struct CompletionRequest {
  GenerationOptions opts;
  std::vector<PromptInput> prompts;  // a batch: choices are indexed prompt * n + i
  bool echo = false;
};

struct ChatCompletionRequest {
  GenerationOptions opts;
  std::vector<ChatMessage> messages;
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  // Tool calling: the function definitions (null when none) and tool_choice "auto" or "none"
  // ("required" and named functions need guided decoding and are refused).
  OJson tools = nullptr;
  std::string tool_choice = "auto";
};

// Limits the parser enforces.
struct ProtocolLimits {
  int max_n = 64;
  int max_stop_strings = 64;
  int max_prompts = 64;       // prompts in one completions request
  int max_choices = 128;      // prompts x n: the engine sequences one request may hold
  int max_logit_bias = 1024;  // entries of logit_bias (vLLM's limit)
  int max_bad_words = 128;
  int vocab_size = 0;         // token ids must be below it (0: not checked here; the engine checks)
};

// Each returns nullopt on success (filling `out`) or the error to answer.
std::optional<ApiError> parse_completion_request(const Json& body, const ProtocolLimits& limits,
                                                 CompletionRequest* out);
std::optional<ApiError> parse_chat_completion_request(const Json& body, const ProtocolLimits& limits,
                                                      ChatCompletionRequest* out);

// vLLM's bad_words rule: each word is encoded without special tokens as given (leading spaces
// stripped) and again after one leading space; the spaced form is kept only when it is a
// different word token of the same length (a tokenizer with add_prefix_space would otherwise ban
// the same sequence twice). `encode` returns the ids of a text. The engine bans a sequence's last
// token where the tokens before it were just generated.
using EncodeFn = std::function<Result<std::vector<int32_t>>(const std::string&)>;
std::optional<ApiError> tokenize_bad_words(const std::vector<std::string>& words, const EncodeFn& encode,
                                           int vocab_size, std::vector<std::vector<int32_t>>* out);

// Chat messages alone (also used by /tokenize).
std::optional<ApiError> parse_chat_messages(const Json& messages, std::vector<ChatMessage>* out);

// The body's "tools": [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
// (`out` stays null when absent or empty). Chat completions and /tokenize read them alike.
std::optional<ApiError> parse_tools(const Json& body, OJson* out);

// Json sorts object keys, but a chat template's tojson shows them, and transformers renders the
// request's tools and the assistant messages' tool_calls in the client's order: both are re-read
// in that order from the raw body (which already passed the strict parse). `tools` may be null.
void keep_client_key_order(std::string_view body, std::vector<ChatMessage>* messages, OJson* tools);

// The body of a POST as a JSON object, or the 400 to answer.
std::optional<ApiError> parse_json_body(const std::string& body, Json* out);

// Typed optional fields with errors that name the parameter.
std::optional<ApiError> read_opt_bool(const Json& obj, const char* key, std::optional<bool>* out);
std::optional<ApiError> read_opt_int(const Json& obj, const char* key, std::optional<int64_t>* out);
std::optional<ApiError> read_opt_number(const Json& obj, const char* key, std::optional<double>* out);
std::optional<ApiError> read_opt_string(const Json& obj, const char* key, std::optional<std::string>* out);
std::optional<ApiError> read_token_ids(const Json& value, const char* param, std::vector<int32_t>* out);

// vLLM's context-length errors (clients parse this wording).
ApiError context_length_error(int max_model_len, int prompt_tokens, int max_tokens);
ApiError prompt_too_long_error(int max_model_len, int prompt_tokens);

}  // namespace moelora::server
