// Tool-call parsing on scripted generations (the bundled model's text is random): Qwen/Hermes,
// DeepSeek-V3 and Mistral formats, whole and streamed in every chunking, malformed output kept
// as content, the response and chunk JSON shapes, format detection, and the request fields.
#include <gtest/gtest.h>

#include <random>

#include "server/openai_protocol.h"
#include "server/openai_responses.h"
#include "server/tool_calls.h"

namespace moelora::server {
namespace {

const std::string kDs = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                        "{\"city\": \"Paris\", \"unit\": \"c\"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function"
                        "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

struct Case {
  ToolCallFormat format;
  std::string text;
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};

std::vector<Case> cases() {
  return {
      {ToolCallFormat::kHermes,
       "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
       "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
       "Let me check.\n",
       {{"get_weather", "{\"city\":\"Paris\"}"}, {"get_time", "{}"}}},
      {ToolCallFormat::kHermes, "plain answer, no call", "plain answer, no call", {}},
      // Broken JSON, an unclosed call, a call without a name: text stays content.
      {ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>",
       "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>", {}},
      {ToolCallFormat::kHermes, "x <tool_call>{\"name\": \"f\", \"arguments\": {}}", "x <tool_call>{\"name\": \"f\", \"arguments\": {}}", {}},
      {ToolCallFormat::kHermes, "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>", {}},
      // A string "arguments" holding JSON, and trailing text after the calls kept as content.
      {ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call> done",
       "done", {{"f", "{\"a\": 1}"}}},
      {ToolCallFormat::kDeepSeekV3, "Sure." + kDs, "Sure.",
       {{"get_weather", "{\"city\":\"Paris\",\"unit\":\"c\"}"}, {"get_time", "{}"}}},
      {ToolCallFormat::kDeepSeekV3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>",
       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>", {}},
      {ToolCallFormat::kMistral,
       "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris, \\\"FR\\\" {x}\"}}, "
       "{\"name\": \"get_time\", \"arguments\": {}}]",
       "", {{"get_weather", "{\"city\":\"Paris, \\\"FR\\\" {x}\"}"}, {"get_time", "{}"}}},
      {ToolCallFormat::kMistral, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}", "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}", {}},
      {ToolCallFormat::kMistral, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", {}},
  };
}

void expect_parsed(const Case& c, const std::string& content, const std::vector<ToolCall>& calls) {
  EXPECT_EQ(content, c.content) << c.text;
  ASSERT_EQ(calls.size(), c.calls.size()) << c.text;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].name, c.calls[i].first);
    EXPECT_EQ(calls[i].arguments, c.calls[i].second);
    if (c.format == ToolCallFormat::kMistral) EXPECT_EQ(calls[i].id.size(), 9u);
    else EXPECT_TRUE(calls[i].id.starts_with("call_")) << calls[i].id;
  }
}

TEST(ToolCalls, WholeTextParsesEachFormatAndKeepsMalformedOutputAsContent) {
  for (const Case& c : cases()) {
    const ParsedToolCalls p = parse_tool_calls(c.format, c.text);
    expect_parsed(c, p.content, p.calls);
  }
  // A model without a known format: everything is content.
  EXPECT_EQ(parse_tool_calls(ToolCallFormat::kNone, kDs).content, kDs);
}

// Streamed in random chunkings (splitting markers and multi-byte characters), the content
// deltas and call deltas add up to the whole-text result, and every call arrives as OpenAI
// streams it: a first delta with id, type and name, then its arguments.
TEST(ToolCalls, StreamingMatchesTheWholeTextInEveryChunking) {
  std::mt19937 rng(11);
  for (const Case& c : cases()) {
    for (int trial = 0; trial < 200; ++trial) {
      ToolCallStreamParser parser(c.format);
      std::string content;
      OJson deltas = OJson::array();
      for (size_t pos = 0; pos < c.text.size();) {
        const size_t n = std::min<size_t>(c.text.size() - pos, trial == 0 ? c.text.size() : 1 + rng() % 7);
        auto d = parser.feed(std::string_view(c.text).substr(pos, n));
        content += d.content;
        for (auto& x : d.tool_calls) deltas.push_back(x);
        pos += n;
      }
      auto end = parser.finish();
      content += end.content;
      for (auto& x : end.tool_calls) deltas.push_back(x);
      std::vector<ToolCall> calls;
      for (const OJson& d : deltas) {
        const int index = d["index"].get<int>();
        if (d.contains("id")) {
          ASSERT_EQ(index, static_cast<int>(calls.size()));
          EXPECT_EQ(d["type"], "function");
          EXPECT_EQ(d["function"]["arguments"], "");
          calls.push_back({d["id"], d["function"]["name"], ""});
        } else {
          ASSERT_EQ(index + 1, static_cast<int>(calls.size()));
          EXPECT_FALSE(d["function"].contains("name"));
          calls.back().arguments += d["function"]["arguments"].get<std::string>();
        }
      }
      expect_parsed(c, content, calls);
      EXPECT_EQ(parser.called(), !c.calls.empty());
    }
  }
}

TEST(ToolCalls, ResponseAndChunkShapes) {
  ResponseHeader h{ApiKind::kChat, "chatcmpl-1", "m", 1};
  const ParsedToolCalls p = parse_tool_calls(ToolCallFormat::kHermes, cases()[0].text);
  ChoiceOutput o;
  o.text = "";
  o.tool_calls = tool_calls_json(p.calls);
  o.finish_reason = "tool_calls";
  const OJson r = response_json(h, {o}, {});
  const OJson& msg = r["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  ASSERT_EQ(msg["tool_calls"].size(), 2u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  // With content, content stays a string.
  o.text = "Let me check.\n";
  EXPECT_EQ(response_json(h, {o}, {})["choices"][0]["message"]["content"], "Let me check.\n");
  ChoiceOutput chunk;
  chunk.tool_calls = OJson::array({{{"index", 0}, {"function", {{"arguments", "{}"}}}}});
  const OJson cj = chunk_json(h, {chunk}, std::nullopt);
  EXPECT_EQ(cj["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"], "{}");
  EXPECT_FALSE(cj["choices"][0]["delta"].contains("content"));
}

TEST(ToolCalls, FormatDetectionPrefersVocabularyTokens) {
  const auto none = [](std::string_view) { return false; };
  const auto tokens = [](std::initializer_list<std::string_view> list) {
    return [list](std::string_view t) { return std::find(list.begin(), list.end(), t) != list.end(); };
  };
  EXPECT_EQ(detect_tool_call_format(tokens({"<｜tool▁calls▁begin｜>"}), none), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(detect_tool_call_format(tokens({"[TOOL_CALLS]"}), none), ToolCallFormat::kMistral);
  EXPECT_EQ(detect_tool_call_format(tokens({"<tool_call>"}), none), ToolCallFormat::kHermes);
  EXPECT_EQ(detect_tool_call_format(none, tokens({"<tool_call>"})), ToolCallFormat::kHermes);
  EXPECT_EQ(detect_tool_call_format(none, none), ToolCallFormat::kNone);
  EXPECT_TRUE(tool_markers_are_special(ToolCallFormat::kMistral));
  EXPECT_FALSE(tool_markers_are_special(ToolCallFormat::kHermes));
}

TEST(ToolCalls, RequestFieldsAreParsedAndValidated) {
  const auto parse = [](const char* body, ChatCompletionRequest* r) {
    return parse_chat_completion_request(Json::parse(body), ProtocolLimits{}, r);
  };
  ChatCompletionRequest r;
  auto err = parse(R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "42"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto"})", &r);
  ASSERT_FALSE(err) << err->message;
  ASSERT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_EQ(r.messages[1].tool_fields["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(r.messages[2].tool_fields["tool_call_id"], "call_1");
  EXPECT_EQ(r.messages[2].tool_fields["name"], "f");

  ChatCompletionRequest r2;
  err = parse(R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",
    "function": {"name": "f"}}], "tool_choice": "required"})", &r2);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->param, "tool_choice");
  ChatCompletionRequest r3;
  err = parse(R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})", &r3);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->param, "tools");
  ChatCompletionRequest r4;
  err = parse(R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]})", &r4);
  ASSERT_TRUE(err);
  CompletionRequest c;
  err = parse_completion_request(Json::parse(R"({"prompt": "x", "tools": [{"type": "function",
    "function": {"name": "f"}}]})"), ProtocolLimits{}, &c);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->param, "tools");
}

}  // namespace
}  // namespace moelora::server
