// Who may call the server and what it answers, over raw sockets: API keys, JSON-only POSTs,
// Host checks, runtime adapter loading gated on --lora-root, honest statuses of non-streamed
// responses, disconnects noticed without writes, X-Request-Id, refusals of unimplemented fields.
#include <atomic>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "server/server_state.h"
#include "tests/server/raw_http.h"

namespace moelora::server::testing {
namespace {

using namespace std::chrono_literals;

TEST(ServerAuth, BearerComparisonAcceptsOnlyAConfiguredKey) {
  const std::vector<std::string> keys = {"alpha-key", "beta"};
  EXPECT_TRUE(bearer_token_matches("Bearer alpha-key", keys));
  EXPECT_TRUE(bearer_token_matches("bearer beta", keys));
  EXPECT_FALSE(bearer_token_matches("Bearer alpha", keys));
  EXPECT_FALSE(bearer_token_matches("Bearer alpha-key2", keys));
  EXPECT_FALSE(bearer_token_matches("Basic alpha-key", keys));
  EXPECT_FALSE(bearer_token_matches("", keys));
  EXPECT_FALSE(bearer_token_matches("Bearer ", {""}));
}

TEST(ServerAuth, KeysAreRequiredOnApiRoutesOnly) {
  ServerOptions o;
  o.api_keys = {"k1", "k2"};
  TinyServer s(o);
  for (const std::string& req :
       {get_req("/v1/models"), post_json("/v1/completions", R"({"prompt": "x", "max_tokens": 1})"),
        post_json("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}]})"),
        post_json("/tokenize", R"({"prompt": "x"})"), post_json("/detokenize", R"({"tokens": [1]})"),
        post_json("/v1/load_lora_adapter", R"({"lora_name": "a", "lora_path": "/tmp"})"),
        post_json("/v1/unload_lora_adapter", R"({"lora_name": "a"})")}) {
    for (const std::string& auth : {std::string(), std::string("Authorization: Bearer wrong\r\n"),
                                    std::string("Authorization: k1\r\n")}) {
      std::string r = req;
      r.insert(r.find("\r\n") + 2, auth);
      const auto res = s.call(r);
      EXPECT_EQ(res.status, 401) << req.substr(0, 40) << " / " << auth;
      EXPECT_NE(res.body.find("\"AuthenticationError\""), std::string::npos) << res.body;
      EXPECT_NE(res.body.find("\"code\":401"), std::string::npos) << res.body;
      EXPECT_EQ(res.header("www-authenticate"), "Bearer");
    }
  }
  EXPECT_EQ(s.call(get_req("/v1/models", "Authorization: Bearer k2\r\n")).status, 200);
  EXPECT_EQ(s.call(post_json("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", "Authorization: Bearer k1\r\n"))
                .status,
            200);
  for (const char* open : {"/health", "/metrics", "/version"}) EXPECT_EQ(s.call(get_req(open)).status, 200) << open;
}

TEST(ServerOrigin, PostBodiesMustBeJson) {
  TinyServer s(ServerOptions{});
  const std::string body = R"({"prompt": "x", "max_tokens": 1})";
  for (const char* type : {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""}) {
    std::string req = fmt::format("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{}Content-Length: {}\r\n\r\n{}",
                                  *type ? fmt::format("Content-Type: {}\r\n", type) : "", body.size(), body);
    const auto r = s.call(req);
    EXPECT_EQ(r.status, 415) << type;
  }
  EXPECT_EQ(s.call(fmt::format("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: Application/JSON; "
                               "charset=utf-8\r\nContent-Length: {}\r\n\r\n{}",
                               body.size(), body))
                .status,
            200);
  // A text/plain load request (what any web page may send to 127.0.0.1) never reaches the handler.
  const std::string load = R"({"lora_name": "x", "lora_path": "/tmp"})";
  EXPECT_EQ(s.call(fmt::format("POST /v1/load_lora_adapter HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                               "Content-Length: {}\r\n\r\n{}",
                               load.size(), load))
                .status,
            415);
}

TEST(ServerOrigin, HostHeaderIsCheckedOnLoopback) {
  TinyServer s(ServerOptions{});
  for (const char* host : {"127.0.0.1", "localhost:8000", "[::1]:1234", "127.0.0.1:80"})
    EXPECT_EQ(s.call(fmt::format("GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", host)).status, 200) << host;
  // DNS rebinding: a page on attacker.example resolves its name to 127.0.0.1; its Host gives it away.
  for (const char* host : {"attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example"})
    EXPECT_EQ(s.call(fmt::format("GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", host)).status, 400) << host;

  ServerOptions listed;
  listed.allowed_hosts = {"api.internal"};
  TinyServer t(listed);
  EXPECT_EQ(t.call("GET /health HTTP/1.1\r\nHost: api.internal:8000\r\n\r\n").status, 200);
  EXPECT_EQ(t.call("GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").status, 400);
}

TEST(ServerAdapters, RuntimeLoadingNeedsLoraRoot) {
  ServerOptions o;
  o.allow_runtime_lora = true;  // without a root it stays off
  TinyServer s(o);
  const std::string path = tiny_model_dir() + "/adapters/attn-r8";
  const auto r = s.call(post_json("/v1/load_lora_adapter", fmt::format(R"({{"lora_name": "x", "lora_path": "{}"}})", path)));
  EXPECT_EQ(r.status, 403) << r.body;
  EXPECT_NE(r.body.find("--lora-root"), std::string::npos) << r.body;
  // The bundled adapters are still served.
  EXPECT_EQ(s.call(post_json("/v1/completions", R"({"model": "attn-r8", "prompt": "x", "max_tokens": 1})")).status, 200);

  ServerOptions rooted;
  rooted.allow_runtime_lora = true;
  rooted.lora_root = tiny_model_dir();
  TinyServer t(rooted);
  EXPECT_EQ(t.call(post_json("/v1/load_lora_adapter", fmt::format(R"({{"lora_name": "x", "lora_path": "{}"}})", path))).status,
            200);
  EXPECT_EQ(t.call(post_json("/v1/load_lora_adapter", R"({"lora_name": "y", "lora_path": "/etc"})")).status, 400);
}

TEST(ServerStatus, RequestIdIsEchoedAndNamesTheResponse) {
  TinyServer s(ServerOptions{});
  const auto r = s.call(post_json("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", "X-Request-Id: trace-42\r\n"));
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("x-request-id"), "trace-42");
  EXPECT_NE(r.body.find("\"id\":\"cmpl-trace-42\""), std::string::npos) << r.body;
  // Errors carry it too; an absent one is generated.
  const auto e = s.call(post_json("/v1/completions", R"({"prompt": 5})", "X-Request-Id: bad-1\r\n"));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.header("x-request-id"), "bad-1");
  EXPECT_FALSE(s.call(get_req("/health")).header("x-request-id").empty());
  // Two concurrent requests may share an X-Request-Id (engine ids stay unique).
  const std::string slow = post_json("/v1/completions", R"({"prompt": "same id", "max_tokens": 30, "ignore_eos": true})",
                                     "X-Request-Id: shared\r\n");
  RawConn a(s.port()), b(s.port());
  a.send(slow);
  b.send(slow);
  EXPECT_EQ(a.read_response().status, 200);
  EXPECT_EQ(b.read_response().status, 200);
}

TEST(ServerStatus, ALongNonStreamedRequestKeepsItsRealErrorStatus) {
  ServerOptions o;
  o.heartbeat = 20ms;  // the old server committed 200 after two heartbeats
  EngineOptions e;
  e.max_num_seqs = 1;
  TinyServer s(o, e);
  RawConn c(s.port(), 30s);
  c.send(post_json("/v1/completions", R"({"prompt": "long", "max_tokens": 200, "ignore_eos": true, "n": 8})"));
  std::this_thread::sleep_for(300ms);
  std::thread stopper([&] { s.http().shutdown(0ms); });  // cancels it: 503, not "200 + error body"
  const auto r = c.read_response();
  stopper.join();
  EXPECT_EQ(r.status, 503) << r.head << r.body.substr(0, 200);
  EXPECT_NE(r.body.find("\"code\":503"), std::string::npos);
  EXPECT_EQ(r.body.find_first_not_of(" \n"), 0u) << "no whitespace padding before the JSON";
}

TEST(ServerStatus, AClientThatLeavesIsNoticedWithoutAnyWrite) {
  ServerOptions o;
  o.heartbeat = 10000ms;  // no heartbeat could notice it
  EngineOptions e;
  e.max_num_seqs = 1;
  TinyServer s(o, e);
  RawConn busy(s.port(), 60s);
  busy.send(post_json("/v1/completions", R"({"prompt": "keeps the engine busy", "max_tokens": 200, "ignore_eos": true, "n": 6})"));
  {
    RawConn leaver(s.port());
    leaver.send(post_json("/v1/completions", R"({"prompt": "queued then abandoned", "max_tokens": 200, "ignore_eos": true})"));
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (metric(s.port(), "moelora_http_requests_active") < 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(5ms);
    ASSERT_EQ(metric(s.port(), "moelora_http_requests_active"), 2);
  }  // closed while waiting in the queue
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (metric(s.port(), "moelora_http_requests_active") > 1 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(metric(s.port(), "moelora_http_requests_active"), 1) << "the abandoned request is still open";
  EXPECT_EQ(busy.read_response().status, 200);
}

TEST(ServerRefusals, UnimplementedFieldsAreNamed) {
  TinyServer s(ServerOptions{});
  for (const char* field :
       {R"("prompt_logprobs": 1)", R"("guided_json": {"type": "object"})", R"("guided_choice": ["a", "b"])",
        R"("structured_outputs": {"choice": ["a"]})", R"("use_beam_search": true)", R"("guided_regex": "a+")"}) {
    const auto r = s.call(post_json("/v1/completions", fmt::format(R"({{"prompt": "x", {}}})", field)));
    EXPECT_EQ(r.status, 400) << field;
    const std::string name = std::string(field).substr(1, std::string(field).find('"', 1) - 1);
    EXPECT_NE(r.body.find("\"param\":\"" + name + "\""), std::string::npos) << r.body;
  }
  // Too many sequences in one request.
  const auto big = s.call(post_json("/v1/completions", R"({"prompt": ["a","b","c","d","e","f","g","h","i"], "n": 16})"));
  EXPECT_EQ(big.status, 400);
  EXPECT_NE(big.body.find("sequences"), std::string::npos) << big.body;
}

TEST(ServerSampling, PenaltiesAndBiasesReachTheEngine) {
  TinyServer s(ServerOptions{});
  // allowed_token_ids with one id: every generated token is that id, whatever the model says.
  const auto r = s.call(post_json(
      "/v1/completions",
      R"({"prompt": "x", "max_tokens": 4, "allowed_token_ids": [65], "return_token_ids": true, "ignore_eos": true,
          "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 2})"));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("\"token_ids\":[65,65,65,65]"), std::string::npos) << r.body;
  const auto bad = s.call(post_json("/v1/completions", R"({"prompt": "x", "logit_bias": {"99999999": 5}})"));
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("\"param\":\"logit_bias\""), std::string::npos) << bad.body;
  const auto words = s.call(post_json("/v1/completions", R"({"prompt": "x", "max_tokens": 2, "bad_words": ["hello", " world"]})"));
  EXPECT_EQ(words.status, 200) << words.body;
  // truncate_prompt_tokens keeps the prompt's last k tokens.
  const auto cut = s.call(post_json("/v1/completions", R"({"prompt": [1,2,3,4,5,6,7,8,9,10], "max_tokens": 1, "truncate_prompt_tokens": 4})"));
  EXPECT_EQ(cut.status, 200) << cut.body;
  EXPECT_NE(cut.body.find("\"prompt_tokens\":4"), std::string::npos) << cut.body;
  EXPECT_EQ(s.call(post_json("/v1/completions", R"({"prompt": "x", "truncate_prompt_tokens": 100000})")).status, 400);
}

}  // namespace
}  // namespace moelora::server::testing
