// SSE framing, stop strings (held-back text), the engine-to-HTTP channel and the shape of
// streamed chunks and whole responses.
#include <gtest/gtest.h>

#include <thread>

#include "server/openai_responses.h"
#include "server/request_channel.h"
#include "server/sse.h"
#include "server/stop_strings.h"

namespace moelora::server {
namespace {

TEST(ServerSse, Framing) {
  EXPECT_EQ(sse_data(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_data(Json{{"t", "line\nbreak"}}), "data: {\"t\":\"line\\nbreak\"}\n\n");
  EXPECT_EQ(sse_data_raw("x\ny"), "data: x y\n\n") << "a raw newline would end the event";
  EXPECT_EQ(sse_done(), "data: [DONE]\n\n");
  EXPECT_EQ(sse_comment("keep-alive"), ": keep-alive\n\n");
}

std::string feed_all(StopStringMatcher& m, const std::vector<std::string>& pieces, bool* stopped, std::string* matched) {
  std::string out;
  for (const std::string& p : pieces) {
    auto r = m.feed(p);
    out += r.text;
    if (r.stopped) {
      *stopped = true;
      *matched = r.matched;
      return out;
    }
  }
  return out + m.flush();
}

TEST(ServerStopStrings, MatchAcrossPiecesAndHoldBackPrefixes) {
  StopStringMatcher m({"END"}, false);
  auto r = m.feed("abc E");
  EXPECT_EQ(r.text, "abc ") << "'E' could start END: held back";
  r = m.feed("N");
  EXPECT_EQ(r.text, "");
  r = m.feed("Dxyz");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
  EXPECT_EQ(r.matched, "END");
  EXPECT_EQ(m.feed("more").text, "") << "nothing after a stop";
}

TEST(ServerStopStrings, FalseAlarmReleasesHeldText) {
  StopStringMatcher m({"END"}, false);
  bool stopped = false;
  std::string matched;
  EXPECT_EQ(feed_all(m, {"a E", "N", "d!"}, &stopped, &matched), "a ENd!");
  EXPECT_FALSE(stopped);
  StopStringMatcher tail({"END"}, false);
  EXPECT_EQ(feed_all(tail, {"xE", "N"}, &stopped, &matched), "xEN") << "flush releases an unfinished prefix";
}

TEST(ServerStopStrings, EarliestMatchAndIncludeOption) {
  StopStringMatcher m({"world", "lo"}, true);
  auto r = m.feed("hello world");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.matched, "lo");
  EXPECT_EQ(r.text, "hello");
  StopStringMatcher none({}, false);
  EXPECT_EQ(none.feed("anything").text, "anything");
  EXPECT_FALSE(none.active());
}

TEST(ServerStopStrings, MultibyteStopStrings) {
  StopStringMatcher m({"\xe2\x82\xac"}, false);  // €
  EXPECT_EQ(m.feed("5 \xe2\x82").text, "5 ") << "held back on a character boundary";
  auto r = m.feed("\xac!");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
}

TEST(ServerRequestChannel, CoalescesWhileTheReaderIsSlowAndObservesLatency) {
  ServerMetrics metrics("m", 4);
  auto ch = std::make_shared<RequestChannel>(2, Clock::now(), &metrics);
  for (int i = 0; i < 50; ++i) {
    RequestOutput o;
    o.tokens.push_back({i, -0.5f, {}});
    o.completion_tokens = i + 1;
    ch->deliver(i % 2, o);
  }
  RequestOutput fin;
  fin.finished = true;
  fin.reason = FinishReason::kLength;
  ch->deliver(0, fin);
  std::vector<ChoiceDelivery> got;
  ASSERT_TRUE(ch->wait_take(std::chrono::milliseconds(10), &got));
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].tokens.size(), 25u);
  EXPECT_EQ(got[1].tokens.size(), 25u);
  EXPECT_EQ(got[1].tokens.back().token, 49);
  EXPECT_TRUE(got[0].finished);
  EXPECT_FALSE(got[1].finished);
  EXPECT_FALSE(ch->wait_take(std::chrono::milliseconds(1), &got)) << "nothing new";
  const std::string text = metrics.render(EngineStats{}, 0, 0);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 2"), std::string::npos);
  EXPECT_NE(text.find("vllm:inter_token_latency_seconds_count{model_name=\"m\"} 48"), std::string::npos);
  EXPECT_NE(text.find("vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 1"),
            std::string::npos);
}

TEST(ServerRequestChannel, WakesAWaitingReader) {
  auto ch = std::make_shared<RequestChannel>(1, Clock::now(), nullptr);
  std::thread engine([ch] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    RequestOutput o;
    o.tokens.push_back({3, 0, {}});
    ch->deliver(0, o);
  });
  std::vector<ChoiceDelivery> got;
  EXPECT_TRUE(ch->wait_take(std::chrono::seconds(5), &got));
  engine.join();
  ASSERT_EQ(got[0].tokens.size(), 1u);
}

TEST(ServerResponses, FieldsKeepOpenAIsOrder) {
  ResponseHeader h{ApiKind::kCompletion, "cmpl-1", "m", 9};
  ChoiceOutput c;
  c.text = "t";
  const std::string s = dump_json(response_json(h, {c}, {1, 1, 0}));
  EXPECT_EQ(s.rfind("{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":9,\"model\":\"m\",\"choices\"", 0), 0u) << s;
}

TEST(ServerResponses, ChunkAndWholeShapes) {
  ResponseHeader h{ApiKind::kChat, "chatcmpl-1", "sql", 123};
  ChoiceOutput first;
  first.role = true;
  OJson c = chunk_json(h, {first}, std::nullopt);
  EXPECT_EQ(c["object"], "chat.completion.chunk");
  EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(c.contains("usage"));
  ChoiceOutput last;
  last.finish_reason = "length";
  c = chunk_json(h, {last}, OJson(nullptr));
  EXPECT_TRUE(c["choices"][0]["delta"].empty());
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(c["usage"].is_null());
  OJson u = usage_chunk_json(h, {7, 3, 4});
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["total_tokens"], 10);
  EXPECT_EQ(u["usage"]["prompt_tokens_details"]["cached_tokens"], 4);

  ResponseHeader hc{ApiKind::kCompletion, "cmpl-1", "base", 5};
  ChoiceOutput whole;
  whole.text = "hello";
  whole.finish_reason = "stop";
  whole.stop_reason = "\n";
  OJson r = response_json(hc, {whole}, {2, 1, 0});
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "hello");
  EXPECT_EQ(r["choices"][0]["stop_reason"], "\n");
  EXPECT_EQ(r["usage"]["completion_tokens"], 1);
}

TEST(ServerResponses, LogprobsFormats) {
  LogprobsBuilder comp(ApiKind::kCompletion);
  comp.add("a", -0.25f, {{"a", -0.25f}, {"b", -2.0f}}, 0);
  comp.add("c", -std::numeric_limits<float>::infinity(), {}, 1);
  OJson j = comp.take();
  EXPECT_EQ(j["tokens"], (OJson{"a", "c"}));
  EXPECT_EQ(j["token_logprobs"][1], -9999.0) << "no infinities in JSON";
  EXPECT_EQ(j["top_logprobs"][0]["b"], -2.0);
  EXPECT_EQ(j["text_offset"][1], 1);
  EXPECT_TRUE(comp.empty()) << "take() starts over";
  LogprobsBuilder chat(ApiKind::kChat);
  chat.add("\xc3", -1.0f, {{"x", -1.5f}}, 0);
  j = chat.take();
  EXPECT_EQ(j["content"][0]["bytes"], (OJson{195}));
  EXPECT_EQ(j["content"][0]["top_logprobs"][0]["token"], "x");
}

}  // namespace
}  // namespace moelora::server
