// The tool fields of a request as the chat template gets them: `tools` validated (a tool whose
// "type" is not a string was a 500, now a 400 naming `tools`), and tools and assistant tool_calls
// handed over in the client's key order, as transformers renders them (Json sorts keys).
#include <gtest/gtest.h>

#include "server/openai_protocol.h"

namespace moelora::server {
namespace {

TEST(ToolRequest, ToolsOfEveryMalformedShapeAreA400NamingTools) {
  for (const char* tools : {R"({"type": "function"})", R"([{"type": 5, "function": {"name": "f"}}])",
                            R"([{"type": null, "function": {"name": "f"}}])", R"([{"type": "retrieval", "function": {"name": "f"}}])",
                            R"([{"type": "function", "function": {"name": ""}}])", R"([{"type": "function", "function": {"name": 3}}])",
                            R"([{"type": "function", "function": "f"}])", R"(["f"])", R"([[]])"}) {
    SCOPED_TRACE(tools);
    const Json body = Json::parse(std::string(R"({"messages": [{"role": "user", "content": "hi"}], "tools": )") + tools + "}");
    ChatCompletionRequest r;
    std::optional<ApiError> err;
    ASSERT_NO_THROW(err = parse_chat_completion_request(body, ProtocolLimits{}, &r));
    ASSERT_TRUE(err);
    EXPECT_EQ(err->http_status, 400);
    EXPECT_EQ(err->param, "tools");
    OJson out;
    ASSERT_NO_THROW(err = parse_tools(body, &out));
    ASSERT_TRUE(err);
    EXPECT_EQ(err->param, "tools");
  }
  OJson out = "sentinel";
  EXPECT_FALSE(parse_tools(Json::parse(R"({"tools": [{"function": {"name": "f"}}]})"), &out));
  EXPECT_EQ(out.size(), 1u);  // "type" may be left out
  EXPECT_FALSE(parse_tools(Json::parse(R"({"tools": []})"), &out));
  EXPECT_TRUE(out.is_null());
  EXPECT_FALSE(parse_tools(Json::parse(R"({"messages": []})"), &out));
  EXPECT_TRUE(out.is_null());
}

TEST(ToolRequest, ToolsAndAssistantToolCallsKeepTheClientsKeyOrder) {
  const std::string body = R"({"tools": [{"type": "function", "function": {"name": "get_time", "description": "now",
      "parameters": {"type": "object", "properties": {}}}}],
    "messages": [{"role": "user", "content": "time?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]})";
  ChatCompletionRequest r;
  ASSERT_FALSE(parse_chat_completion_request(Json::parse(body), ProtocolLimits{}, &r));
  // Parsed through Json, the keys come out sorted ...
  EXPECT_EQ(r.messages[1].tool_fields["tool_calls"][0]["function"].dump(), R"({"arguments":"{}","name":"get_time"})");
  keep_client_key_order(body, &r.messages, &r.tools);
  // ... and are restored to the order the client sent.
  EXPECT_EQ(r.messages[1].tool_fields["tool_calls"][0].dump(),
            R"({"id":"call_1","type":"function","function":{"name":"get_time","arguments":"{}"}})");
  EXPECT_EQ(r.tools[0]["function"].dump(),
            R"({"name":"get_time","description":"now","parameters":{"type":"object","properties":{}}})");
  EXPECT_FALSE(r.messages[0].tool_fields.contains("tool_calls"));
  EXPECT_FALSE(r.messages[2].tool_fields.contains("tool_calls"));
  EXPECT_EQ(r.messages[2].tool_fields["tool_call_id"], "call_1");

  // Without tools, only the messages are touched; a null `tools` stays null.
  ChatCompletionRequest plain;
  const std::string no_tools = R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function",
      "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}}]}]})";
  ASSERT_FALSE(parse_chat_completion_request(Json::parse(no_tools), ProtocolLimits{}, &plain));
  keep_client_key_order(no_tools, &plain.messages, &plain.tools);
  EXPECT_TRUE(plain.tools.is_null());
  EXPECT_EQ(plain.messages[0].tool_fields["tool_calls"][0].dump(),
            R"({"type":"function","function":{"name":"f","arguments":"{\"b\": 1, \"a\": 2}"}})");
}

}  // namespace
}  // namespace moelora::server
