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

TEST(ServerProtocol, LogitProcessorsFollowVllm) {
  CompletionRequest r;
  ProtocolLimits limits;
  limits.vocab_size = 1000;
  ASSERT_FALSE(parse_completion_request(
      parse(R"({"prompt": "x", "max_tokens": 8, "presence_penalty": -2, "frequency_penalty": 1.5,
                "repetition_penalty": 2, "min_tokens": 8, "logit_bias": {"5": -100, "999": 100, "7": 0.5},
                "allowed_token_ids": [1, 2, 999], "bad_words": ["hi", " there"], "truncate_prompt_tokens": -1,
                "cache_salt": "tenant", "request_id": "abc", "add_special_tokens": false,
                "use_beam_search": false, "prompt_logprobs": null, "priority": 0, "length_penalty": 1})"),
      limits, &r));
  const SamplingParams& s = r.opts.sampling;
  EXPECT_FLOAT_EQ(s.presence_penalty, -2.0f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, 1.5f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 2.0f);
  EXPECT_EQ(s.min_tokens, 8);
  ASSERT_EQ(s.logit_bias.size(), 3u);
  EXPECT_EQ(s.logit_bias[0], (std::pair<int32_t, float>{5, -100.0f}));
  EXPECT_EQ(s.allowed_token_ids, (std::vector<int32_t>{1, 2, 999}));
  EXPECT_EQ(r.opts.bad_words, (std::vector<std::string>{"hi", " there"}));
  EXPECT_EQ(r.opts.truncate_prompt_tokens, -1);
  EXPECT_EQ(r.opts.cache_salt, "tenant");
  EXPECT_EQ(r.opts.request_id, "abc");
  EXPECT_EQ(r.opts.add_special_tokens, false);
  // Ids beyond the vocabulary, and more than 1024 biases, are refused.
  for (const char* body : {R"({"prompt": "x", "logit_bias": {"1000": 1}})", R"({"prompt": "x", "allowed_token_ids": [1000]})"}) {
    CompletionRequest bad;
    auto e = parse_completion_request(parse(body), limits, &bad);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->http_status, 400);
  }
  Json many = Json::object();
  for (int i = 0; i < 1025; ++i) many[std::to_string(i)] = 1;
  CompletionRequest bad;
  auto e = parse_completion_request(Json{{"prompt", "x"}, {"logit_bias", many}}, ProtocolLimits{}, &bad);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "logit_bias");
  // A chat's min_tokens is checked against max_tokens once that is known (GenerationJob).
  ChatCompletionRequest c;
  EXPECT_FALSE(chat(R"({"messages": [{"role": "user", "content": "x"}], "min_tokens": 50})", &c));
  EXPECT_EQ(c.opts.sampling.min_tokens, 50);
}

TEST(ServerProtocol, BadWordsAreTokenizedWithAndWithoutALeadingSpace) {
  // A toy tokenizer: a leading space is its own token 100 unless the word is "hi" (then " hi"
  // is the single word token 200); every other byte is its own id.
  auto encode = [](const std::string& text) -> Result<std::vector<int32_t>> {
    if (text == " hi") return std::vector<int32_t>{200};
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c == ' ' ? 100 : c);
    return ids;
  };
  std::vector<std::vector<int32_t>> out;
  ASSERT_FALSE(tokenize_bad_words({"hi", "  ab"}, encode, 1000, &out));
  // "hi" -> [h, i]; " hi" -> [200] has a different length: not added (vLLM's rule).
  // "ab" (leading spaces stripped) -> [a, b]; " ab" -> [100, a, b]: longer, not added.
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0], (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(out[1], (std::vector<int32_t>{'a', 'b'}));
  auto word_tokens = [](const std::string& text) -> Result<std::vector<int32_t>> {
    if (text == "hello") return std::vector<int32_t>{7};
    if (text == " hello") return std::vector<int32_t>{8};
    return std::vector<int32_t>{1, 2};
  };
  out.clear();
  ASSERT_FALSE(tokenize_bad_words({"hello"}, word_tokens, 1000, &out));
  ASSERT_EQ(out.size(), 2u) << "the spaced form is a different single word token: banned too";
  EXPECT_EQ(out[1], (std::vector<int32_t>{8}));
  out.clear();
  auto e = tokenize_bad_words({"   "}, encode, 1000, &out);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "bad_words");
  e = tokenize_bad_words({"hello"}, word_tokens, 5, &out);
  ASSERT_TRUE(e.has_value()) << "token 7 is outside a vocabulary of 5";
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

// Token-id prompts are checked against the vocabulary in every form (found by fuzz_openai_requests:
// a token-id prompt inside a batch passed the parser with an id past the vocabulary).
TEST(ServerProtocol, TokenIdPromptsOutsideTheVocabularyAreRefused) {
  ProtocolLimits limits;
  limits.vocab_size = 1000;
  for (const char* body : {R"({"prompt": [2, 2, 37777]})", R"({"prompt": ["a", [2, 2, 37777]]})",
                           R"({"prompt": [[1], [1000]]})"}) {
    CompletionRequest r;
    const auto e = parse_completion_request(parse(body), limits, &r);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->http_status, 400) << body;
    EXPECT_EQ(e->param, "prompt") << body;
  }
  CompletionRequest ok;
  EXPECT_FALSE(parse_completion_request(parse(R"({"prompt": ["a", [0, 999]]})"), limits, &ok));
  EXPECT_EQ(ok.prompts.size(), 2u);
}

// One request may not hold more engine sequences than ProtocolLimits::max_choices (prompts x n):
// 64 prompts x n 64 = 4,096 sequences used to be accepted from a single client.
TEST(ServerProtocol, PromptsTimesNIsCapped) {
  auto prompts = [](int count) {
    std::string p = "[";
    for (int i = 0; i < count; ++i) p += (i ? ",\"p" : "\"p") + std::to_string(i) + "\"";
    return p + "]";
  };
  const int cap = ProtocolLimits{}.max_choices;
  EXPECT_FALSE(completion(R"({"prompt": )" + prompts(cap / 2) + R"(, "n": 2})"));  // exactly the cap
  const auto over = completion(R"({"prompt": )" + prompts(64) + R"(, "n": 64})");
  ASSERT_TRUE(over);
  EXPECT_EQ(over->http_status, 400);
  EXPECT_EQ(over->param, "n");
  EXPECT_NE(over->message.find("4096"), std::string::npos) << over->message;
  EXPECT_TRUE(completion(R"({"prompt": )" + prompts(cap + 1) + R"(})"));  // one past the cap, n = 1
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
      {R"({"prompt": "x", "presence_penalty": 2.5})", "presence_penalty"},
      {R"({"prompt": "x", "frequency_penalty": -2.1})", "frequency_penalty"},
      {R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty"},
      {R"({"prompt": "x", "repetition_penalty": 2.5})", "repetition_penalty"},
      {R"({"prompt": "x", "min_tokens": -1})", "min_tokens"},
      {R"({"prompt": "x", "max_tokens": 4, "min_tokens": 5})", "min_tokens"},
      {R"({"prompt": "x", "logit_bias": {"1": 101}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"one": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"-1": 1}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"1": "big"}})", "logit_bias"},
      {R"({"prompt": "x", "logit_bias": [1, 2]})", "logit_bias"},
      {R"({"prompt": "x", "allowed_token_ids": []})", "allowed_token_ids"},
      {R"({"prompt": "x", "allowed_token_ids": [1, -1]})", "allowed_token_ids"},
      {R"({"prompt": "x", "bad_words": "no"})", "bad_words"},
      {R"({"prompt": "x", "bad_words": ["a", 1]})", "bad_words"},
      {R"({"prompt": "x", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens"},
      {R"({"prompt": "x", "cache_salt": ""})", "cache_salt"},
      {R"({"prompt": "x", "prompt_logprobs": 1})", "prompt_logprobs"},
      {R"({"prompt": "x", "use_beam_search": true})", "use_beam_search"},
      {R"({"prompt": "x", "guided_json": {"type": "object"}})", "guided_json"},
      {R"({"prompt": "x", "guided_choice": ["a"]})", "guided_choice"},
      {R"({"prompt": "x", "guided_regex": "a+"})", "guided_regex"},
      {R"({"prompt": "x", "guided_grammar": "root ::= x"})", "guided_grammar"},
      {R"({"prompt": "x", "structured_outputs": {"json": {}}})", "structured_outputs"},
      {R"({"prompt": "x", "logits_processors": ["x"]})", "logits_processors"},
      {R"({"prompt": "x", "priority": 1})", "priority"},
      {R"({"prompt": "x", "length_penalty": 0.5})", "length_penalty"},
      {R"({"prompt": "x", "return_tokens_as_token_ids": true})", "return_tokens_as_token_ids"},
      {R"({"prompt": "x", "spaces_between_special_tokens": false})", "spaces_between_special_tokens"},
      {R"({"prompt": ["a", "b", "c"], "n": 50})", "n"},
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
