// Request parsing: every field's type and range, vLLM's and sglang's extensions, and the error
// envelope that comes back.
#include <gtest/gtest.h>

#include "server/api_error.h"
#include "server/openai_protocol.h"

namespace moelora::server {
namespace {

Json parse(const std::string& text) { return Json::parse(text); }

std::optional<ApiError> completion(const std::string& body, CompletionRequest* out = nullptr) {
  CompletionRequest r;
  return parse_completion_request(parse(body), ProtocolLimits{}, out ? out : &r);
}

std::optional<ApiError> chat(const std::string& body, ChatCompletionRequest* out = nullptr) {
  ChatCompletionRequest r;
  return parse_chat_completion_request(parse(body), ProtocolLimits{}, out ? out : &r);
}

TEST(ServerProtocol, CompletionDefaultsFollowOpenAI) {
  CompletionRequest r;
  ASSERT_FALSE(completion(R"({"model": "m", "prompt": "hi"})", &r));
  EXPECT_EQ(r.opts.model, "m");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_FALSE(r.prompts[0].is_ids);
  EXPECT_EQ(r.prompts[0].text, "hi");
  EXPECT_EQ(r.opts.sampling.max_tokens, 16);
  EXPECT_FLOAT_EQ(r.opts.sampling.temperature, 1.0f);
  EXPECT_EQ(r.opts.n, 1);
  EXPECT_FALSE(r.opts.stream);
  EXPECT_FALSE(r.opts.want_logprobs);
}

TEST(ServerProtocol, CompletionFieldsAndExtensions) {
  CompletionRequest r;
  ASSERT_FALSE(completion(R"({"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": -1,
      "min_p": 0.1, "seed": 42, "n": 3, "stop": ["a", "bc"], "stop_token_ids": [7], "ignore_eos": true,
      "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2, "echo": false,
      "include_stop_str_in_output": true, "skip_special_tokens": false, "return_token_ids": true,
      "lora_path": "sql", "presence_penalty": 0, "user": "ignored", "unknown_field": {"x": 1}})",
                          &r));
  EXPECT_TRUE(r.prompts[0].is_ids);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.opts.sampling.max_tokens, 5);
  EXPECT_EQ(r.opts.sampling.temperature, 0.0f);
  EXPECT_EQ(r.opts.sampling.top_k, 0);
  EXPECT_EQ(*r.opts.sampling.seed, 42u);
  EXPECT_EQ(r.opts.n, 3);
  EXPECT_EQ(r.opts.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(r.opts.sampling.stop_token_ids, (std::vector<int32_t>{7}));
  EXPECT_TRUE(r.opts.sampling.ignore_eos);
  EXPECT_TRUE(r.opts.stream && r.opts.include_usage);
  EXPECT_TRUE(r.opts.want_logprobs);
  EXPECT_EQ(r.opts.top_logprobs, 2);
  EXPECT_EQ(r.opts.sampling.logprobs, 2);
  EXPECT_TRUE(r.opts.include_stop_str_in_output);
  EXPECT_FALSE(r.opts.skip_special_tokens);
  EXPECT_TRUE(r.opts.return_token_ids);
  EXPECT_EQ(*r.opts.lora_path, "sql");
}

TEST(ServerProtocol, BatchedPrompts) {
  CompletionRequest r;
  ASSERT_FALSE(completion(R"({"prompt": ["a", "b"]})", &r));
  EXPECT_EQ(r.prompts.size(), 2u);
  r = CompletionRequest();
  ASSERT_FALSE(completion(R"({"prompt": [[1, 2], [3]]})", &r));
  EXPECT_EQ(r.prompts.size(), 2u);
  EXPECT_TRUE(r.prompts[1].is_ids);
}

TEST(ServerProtocol, WrongTypesNameTheField) {
  struct Case {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"prompt": 5})", "prompt"},
      {R"({})", "prompt"},
      {R"({"prompt": []})", "prompt"},
      {R"({"prompt": [1, -2]})", "prompt"},
      {R"({"prompt": [1, 2.5]})", "prompt"},
      {R"({"prompt": "x", "max_tokens": "10"})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": -3})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens"},
      {R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "x", "temperature": -1})", "temperature"},
      {R"({"prompt": "x", "top_p": 0})", "top_p"},
      {R"({"prompt": "x", "top_p": 1.5})", "top_p"},
      {R"({"prompt": "x", "top_k": -5})", "top_k"},
      {R"({"prompt": "x", "min_p": 2})", "min_p"},
      {R"({"prompt": "x", "n": 0})", "n"},
      {R"({"prompt": "x", "n": 1000})", "n"},
      {R"({"prompt": "x", "stream": "yes"})", "stream"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "x", "stop": 3})", "stop"},
      {R"({"prompt": "x", "stop": ["a", 1]})", "stop"},
      {R"({"prompt": "x", "model": 7})", "model"},
      {R"({"prompt": "x", "seed": "s"})", "seed"},
      {R"({"prompt": "x", "logprobs": 50})", "logprobs"},
      {R"({"prompt": "x", "presence_penalty": 0.5})", "presence_penalty"},
      {R"({"prompt": "x", "logit_bias": {"1": 5}})", "logit_bias"},
      {R"({"prompt": "x", "best_of": 3})", "best_of"},
      {R"({"prompt": "x", "suffix": "y"})", "suffix"},
  };
  for (const Case& c : cases) {
    auto e = completion(c.body);
    ASSERT_TRUE(e.has_value()) << c.body;
    EXPECT_EQ(e->http_status, 400) << c.body;
    EXPECT_EQ(e->param, c.param) << c.body << ": " << e->message;
    EXPECT_FALSE(e->message.empty());
  }
}

TEST(ServerProtocol, ChatMessagesAndOptions) {
  ChatCompletionRequest r;
  ASSERT_FALSE(chat(R"({"model": "base:sql", "messages": [{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
      {"role": "assistant", "content": null}], "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 3})",
                    &r));
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1].content, "hello");
  EXPECT_EQ(r.opts.sampling.max_tokens, 9);
  EXPECT_TRUE(r.opts.max_tokens_given);
  EXPECT_TRUE(r.opts.want_logprobs);
  EXPECT_EQ(r.opts.top_logprobs, 3);
  EXPECT_TRUE(r.add_generation_prompt);
  // Without max_tokens a chat fills the context (resolved by the server, not here).
  ChatCompletionRequest r2;
  ASSERT_FALSE(chat(R"({"messages": [{"role": "user", "content": "x"}]})", &r2));
  EXPECT_FALSE(r2.opts.max_tokens_given);
}

TEST(ServerProtocol, ChatErrors) {
  for (const char* body : {R"({"messages": []})", R"({"messages": "hi"})", R"({"messages": [{"content": "x"}]})",
                           R"({"messages": [{"role": "wizard", "content": "x"}]})",
                           R"({"messages": [{"role": "user", "content": 5}]})",
                           R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                           R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
                           R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})",
                           R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})"}) {
    auto e = chat(body);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->http_status, 400) << body;
  }
}

TEST(ServerProtocol, JsonBodyErrors) {
  Json j;
  EXPECT_EQ(parse_json_body("", &j)->http_status, 400);
  EXPECT_EQ(parse_json_body("{not json", &j)->http_status, 400);
  EXPECT_EQ(parse_json_body("[1, 2]", &j)->http_status, 400);
  EXPECT_EQ(parse_json_body(R"({"a": 1, "a": 2})", &j)->http_status, 400) << "duplicate keys are ambiguous";
  EXPECT_FALSE(parse_json_body(R"({"a": 1})", &j));
}

TEST(ServerProtocol, ErrorEnvelopeIsVllms) {
  const ApiError e = model_not_found("nope");
  const OJson j = e.to_json();
  EXPECT_EQ(j["error"]["message"], "The model `nope` does not exist.");
  EXPECT_EQ(j["error"]["type"], "NotFoundError");
  EXPECT_EQ(j["error"]["param"], "model");
  EXPECT_EQ(j["error"]["code"], 404);
  EXPECT_TRUE(bad_request("x").to_json()["error"]["param"].is_null());
  EXPECT_EQ(from_status(Status(ErrorCode::kResourceExhausted, "full")).http_status, 429);
  EXPECT_EQ(from_status(Status(ErrorCode::kNotFound, "x")).http_status, 404);
  EXPECT_EQ(from_status(Status(ErrorCode::kInvalidArgument, "x")).http_status, 400);
  EXPECT_EQ(from_status(Status(ErrorCode::kInternal, "x")).http_status, 500);
}

TEST(ServerProtocol, ContextLengthMessageIsVllms) {
  EXPECT_EQ(context_length_error(512, 500, 20).message,
            "This model's maximum context length is 512 tokens. However, you requested 520 tokens (500 in the "
            "messages, 20 in the completion). Please reduce the length of the messages or completion.");
}

TEST(ServerProtocol, InvalidUtf8NeverThrowsWhenSerialised) {
  Json j = {{"text", std::string("ok \xe2\x82")}};
  EXPECT_NO_THROW(dump_json(j));
  EXPECT_NE(dump_json(j).find("\xef\xbf\xbd"), std::string::npos);
}

}  // namespace
}  // namespace moelora::server
