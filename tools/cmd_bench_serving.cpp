// moelora bench-serving: a load generator against a running OpenAI-compatible server (ours or
// another). Requests spread round-robin over N adapters (and the base model if asked), arrive
// as a Poisson process at --request-rate (or all at once), at most --max-concurrency in flight,
// with random prompts of --input-len tokens and --output-len generated tokens (ignore_eos, so
// every request generates exactly that many). Every request streams, so the report has time to
// first token and inter-token latency percentiles as well as throughput. --endpoint
// /v1/chat/completions sends chat bodies (the prompt's text as one user message).
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "io/json_util.h"
#include "tools/bench_record.h"
#include "tools/commands.h"

namespace moelora::tools {

namespace {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string host = "127.0.0.1";
  int port = 8000;
  int num_adapters = -1;  // -1: every adapter the server lists
  std::vector<std::string> adapters;
  bool include_base = false;
  int num_requests = 100;
  double request_rate = 0;  // requests/s; 0 = all at once
  int max_concurrency = 0;  // 0 = unlimited (bounded by --num-requests)
  int input_len = 32;
  int output_len = 32;
  uint64_t seed = 0;
  double temperature = 0.0;
  std::string endpoint = "/v1/completions";
  std::string json_out;
  std::string gpu;  // recorded in the JSON record: the server's GPU, as the caller knows it
  int timeout_s = 600;
  std::string api_key;  // sent as "Authorization: Bearer"
};

bool is_chat(const BenchArgs& a) { return a.endpoint.find("chat/completions") != std::string::npos; }

struct HttpResult {
  int status = 0;
  std::string body;   // the whole body, unless streamed to on_data with status 200
  std::string error;  // connection-level failure
};

// One request on a fresh connection (blocking, Boost.Beast). With `on_data`, a 200 body is
// handed over as it arrives (SSE) instead of being collected.
HttpResult http_call(const BenchArgs& a, const char* method, const std::string& target, const std::string& body,
                     const std::function<void(std::string_view)>& on_data = {}) {
  namespace net = boost::asio;
  namespace beast = boost::beast;
  namespace http = beast::http;
  HttpResult r;
  try {
    net::io_context ioc;
    net::ip::tcp::resolver resolver(ioc);
    net::ip::tcp::socket sock(ioc);
    net::connect(sock, resolver.resolve(a.host, std::to_string(a.port)));
    // Blocking reads and writes give up after --timeout.
    const timeval tv{a.timeout_s, 0};
    setsockopt(sock.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(sock.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    http::request<http::string_body> req{std::string_view(method) == "GET" ? http::verb::get : http::verb::post,
                                         target, 11};
    req.set(http::field::host, fmt::format("{}:{}", a.host, a.port));
    if (!a.api_key.empty()) req.set(http::field::authorization, "Bearer " + a.api_key);
    if (req.method() == http::verb::post) {
      req.set(http::field::content_type, "application/json");
      req.body() = body;
    }
    req.keep_alive(false);
    req.prepare_payload();
    http::write(sock, req);
    beast::flat_buffer buf;
    http::response_parser<http::buffer_body> p;
    p.body_limit(boost::none);
    http::read_header(sock, buf, p);
    r.status = static_cast<int>(p.get().result_int());
    char chunk[16384];
    while (!p.is_done()) {
      p.get().body().data = chunk;
      p.get().body().size = sizeof(chunk);
      beast::error_code ec;
      // read_some: hand over each piece as it arrives. (http::read waits until the 16 KB buffer is
      // full or the body ends, which delivered a short stream all at once: TTFT = end-to-end
      // latency and zero inter-token gaps.)
      http::read_some(sock, buf, p, ec);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) throw beast::system_error(ec);
      const size_t n = sizeof(chunk) - p.get().body().size;
      if (on_data && r.status == 200) on_data(std::string_view(chunk, n));
      else r.body.append(chunk, n);
    }
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

struct RequestResult {
  bool ok = false;
  std::string error;
  std::string model;
  double ttft = 0;
  double e2e = 0;
  int output_tokens = 0;
  std::vector<double> itl;  // per token after the first
};

// Streams one completion and records when its tokens arrive.
RequestResult run_one(const BenchArgs& a, const std::string& model, const std::vector<int32_t>& prompt,
                      const std::string& prompt_text, uint64_t seed) {
  RequestResult r;
  r.model = model;
  Json body = {{"model", model},   {"max_tokens", a.output_len}, {"stream", true},
               {"ignore_eos", true}, {"temperature", a.temperature}, {"seed", seed},
               {"return_token_ids", true}, {"stream_options", {{"include_usage", true}}}};
  // Chat takes messages, not token ids: the prompt's text (built by /detokenize) is the message.
  if (is_chat(a)) body["messages"] = Json::array({Json{{"role", "user"}, {"content", prompt_text}}});
  else body["prompt"] = prompt;
  std::string buf;
  const Clock::time_point start = Clock::now();
  Clock::time_point last;
  bool got_usage = false;
  int usage_tokens = 0;
  auto on_data = [&](std::string_view data) {
    buf.append(data);
    size_t end;
    while ((end = buf.find("\n\n")) != std::string::npos) {
      std::string event = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;  // comments (heartbeats)
      std::string payload = event.substr(6);
      if (payload == "[DONE]") continue;
      Json j = Json::parse(payload, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        r.error = j["error"].value("message", "error event");
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        got_usage = true;
        usage_tokens = j["usage"].value("completion_tokens", 0);
      }
      int tokens = 0;
      for (const Json& c : j.value("choices", Json::array())) {
        // token_ids when the server returns them; else one token per non-empty text piece (a
        // chat stream's opening chunk carries only the role and counts for nothing).
        const Json* delta = c.contains("delta") && c["delta"].is_object() ? &c["delta"] : nullptr;
        const bool text = (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) ||
                          (delta && delta->contains("content") && (*delta)["content"].is_string() &&
                           !(*delta)["content"].get<std::string>().empty());
        if (c.contains("token_ids") && c["token_ids"].is_array()) tokens += static_cast<int>(c["token_ids"].size());
        else if (text) tokens += 1;
      }
      if (tokens == 0) continue;
      const Clock::time_point now = Clock::now();
      if (r.output_tokens == 0) {
        r.ttft = std::chrono::duration<double>(now - start).count();
        // Tokens that arrived together with the first one have no gap of their own.
        for (int k = 1; k < tokens; ++k) r.itl.push_back(0.0);
      } else {
        const double gap = std::chrono::duration<double>(now - last).count() / tokens;
        for (int k = 0; k < tokens; ++k) r.itl.push_back(gap);
      }
      last = now;
      r.output_tokens += tokens;
    }
  };
  const HttpResult res = http_call(a, "POST", a.endpoint, body.dump(), on_data);
  r.e2e = std::chrono::duration<double>(Clock::now() - start).count();
  if (!res.error.empty()) {
    r.error = fmt::format("connection failed: {}", res.error);
  } else if (res.status != 200) {
    r.error = fmt::format("HTTP {}: {}", res.status, res.body.substr(0, 200));
  } else if (r.error.empty()) {
    if (got_usage) r.output_tokens = std::max(r.output_tokens, usage_tokens);
    r.ok = r.output_tokens > 0;
    if (!r.ok) r.error = "no tokens received";
  }
  return r;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// Valid token ids to draw prompts from: what the server's /tokenize makes of some text, else
// the low ids every vocabulary has.
std::vector<int32_t> prompt_vocabulary(const BenchArgs& a) {
  const std::string text =
      "The quick brown fox jumps over the lazy dog while serving many adapters in one batch of tokens, "
      "measuring latency and throughput under load: 0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz";
  const HttpResult res = http_call(a, "POST", "/tokenize", Json{{"prompt", text}, {"add_special_tokens", false}}.dump());
  std::vector<int32_t> ids;
  if (res.error.empty() && res.status == 200) {
    Json j = Json::parse(res.body, nullptr, false);
    if (!j.is_discarded() && j.contains("tokens"))
      for (const Json& t : j["tokens"]) ids.push_back(t.get<int32_t>());
  }
  if (ids.empty())
    for (int32_t i = 32; i < 127; ++i) ids.push_back(i);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

Result<std::vector<std::string>> pick_models(const BenchArgs& a) {
  const HttpResult res = http_call(a, "GET", "/v1/models", "");
  if (!res.error.empty())
    return make_error(ErrorCode::kFailedPrecondition, "no server answers at {}:{} ({})", a.host, a.port, res.error);
  if (res.status != 200)
    return make_error(ErrorCode::kFailedPrecondition, "GET /v1/models: HTTP {}: {}", res.status, res.body.substr(0, 200));
  Json j = Json::parse(res.body, nullptr, false);
  if (j.is_discarded() || !j.contains("data")) return invalid_argument("GET /v1/models: unexpected answer");
  std::string base;
  std::vector<std::string> adapters;
  for (const Json& m : j["data"]) {
    if (m.value("parent", Json(nullptr)).is_null()) base = m.value("id", "");
    else adapters.push_back(m.value("id", ""));
  }
  std::vector<std::string> out;
  if (!a.adapters.empty()) {
    out = a.adapters;
  } else {
    const int n = a.num_adapters < 0 ? static_cast<int>(adapters.size()) : a.num_adapters;
    if (n > static_cast<int>(adapters.size()))
      return invalid_argument("--adapters {} asked for, but the server has {}", n, adapters.size());
    out.assign(adapters.begin(), adapters.begin() + n);
  }
  if (a.include_base || out.empty()) out.insert(out.begin(), base);
  return out;
}

int run_bench(const BenchArgs& a) {
  auto models = pick_models(a);
  if (!models.ok()) {
    std::fprintf(stderr, "moelora bench-serving: %s\n", models.status().message().c_str());
    return 2;
  }
  const std::vector<int32_t> vocab = prompt_vocabulary(a);
  std::mt19937_64 rng(a.seed);
  struct Planned {
    std::string model;
    std::vector<int32_t> prompt;
    std::string text;  // chat: the prompt as text
    double at = 0;     // seconds after start
  };
  std::vector<Planned> plan(a.num_requests);
  double t = 0;
  std::exponential_distribution<double> gap(a.request_rate > 0 ? a.request_rate : 1.0);
  for (int i = 0; i < a.num_requests; ++i) {
    plan[i].model = (*models)[i % models->size()];
    for (int k = 0; k < a.input_len; ++k) plan[i].prompt.push_back(vocab[rng() % vocab.size()]);
    if (is_chat(a)) {
      const HttpResult d = http_call(a, "POST", "/detokenize", Json{{"tokens", plan[i].prompt}}.dump());
      Json j = d.status == 200 ? Json::parse(d.body, nullptr, false) : Json();
      if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string()) {
        std::fprintf(stderr, "moelora bench-serving: /detokenize failed (HTTP %d): %s\n", d.status,
                     (d.error.empty() ? d.body : d.error).substr(0, 200).c_str());
        return 2;
      }
      plan[i].text = j["prompt"].get<std::string>();
    }
    if (a.request_rate > 0) t += gap(rng);
    plan[i].at = a.request_rate > 0 ? t : 0.0;
  }
  // One thread per request in flight; "unlimited" concurrency still stops at 1024 threads.
  const int workers = std::min({a.max_concurrency > 0 ? a.max_concurrency : 1024, a.num_requests, 1024});
  std::printf("bench-serving: %d requests over %zu model(s) [%s], input %d, output %d tokens, rate %s, "
              "concurrency %s\n",
              a.num_requests, models->size(), fmt::format("{}", fmt::join(*models, ", ")).c_str(), a.input_len,
              a.output_len, a.request_rate > 0 ? fmt::format("{}/s (Poisson)", a.request_rate).c_str() : "unbounded",
              a.max_concurrency > 0 ? std::to_string(a.max_concurrency).c_str() : "unbounded");
  std::fflush(stdout);

  std::vector<RequestResult> results(a.num_requests);
  std::atomic<int> next{0};
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> pool;
  for (int w = 0; w < std::max(1, workers); ++w)
    pool.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < a.num_requests;) {
        const auto due = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(plan[i].at));
        std::this_thread::sleep_until(due);
        results[i] = run_one(a, plan[i].model, plan[i].prompt, plan[i].text, a.seed + static_cast<uint64_t>(i));
      }
    });
  for (auto& th : pool) th.join();
  const double duration = std::chrono::duration<double>(Clock::now() - start).count();

  std::vector<double> ttft, itl, e2e, tpot;
  int ok = 0;
  long out_tokens = 0;
  std::string first_error;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++ok;
    out_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    if (r.output_tokens > 1) tpot.push_back((r.e2e - r.ttft) / (r.output_tokens - 1));
  }
  const long in_tokens = static_cast<long>(ok) * a.input_len;
  auto ms = [](double s) { return s * 1000.0; };
  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-36s %10d\n", "Successful requests:", ok);
  std::printf("%-36s %10d\n", "Failed requests:", a.num_requests - ok);
  if (!first_error.empty()) std::printf("%-36s %s\n", "First error:", first_error.c_str());
  std::printf("%-36s %10.2f\n", "Benchmark duration (s):", duration);
  std::printf("%-36s %10ld\n", "Total input tokens:", in_tokens);
  std::printf("%-36s %10ld\n", "Total generated tokens:", out_tokens);
  std::printf("%-36s %10.2f\n", "Request throughput (req/s):", ok / duration);
  std::printf("%-36s %10.2f\n", "Output token throughput (tok/s):", out_tokens / duration);
  std::printf("%-36s %10.2f\n", "Total token throughput (tok/s):", (in_tokens + out_tokens) / duration);
  auto block = [&](const char* title, const char* key, const std::vector<double>& v) {
    std::printf("---------------%s---------------\n", title);
    std::printf("%-36s %10.2f\n", fmt::format("Mean {} (ms):", key).c_str(), ms(mean(v)));
    for (double p : {50.0, 90.0, 99.0})
      std::printf("%-36s %10.2f\n", fmt::format("P{:.0f} {} (ms):", p, key).c_str(), ms(percentile(v, p)));
  };
  block("Time to First Token", "TTFT", ttft);
  block("Time per Output Token (excl. 1st token)", "TPOT", tpot);
  block("Inter-token Latency", "ITL", itl);
  block("End-to-end Latency", "E2EL", e2e);
  std::printf("==================================================\n");
  if (!a.json_out.empty()) {
    Json j = {{"successful_requests", ok},
              {"failed_requests", a.num_requests - ok},
              {"duration_s", duration},
              {"input_tokens", in_tokens},
              {"output_tokens", out_tokens},
              {"request_throughput", ok / duration},
              {"output_throughput", out_tokens / duration},
              {"models", *models}};
    for (auto [key, v] : {std::pair{"ttft", &ttft}, {"tpot", &tpot}, {"itl", &itl}, {"e2el", &e2e}}) {
      j[std::string("mean_") + key + "_ms"] = ms(mean(*v));
      for (double p : {50.0, 90.0, 99.0}) j[fmt::format("p{:.0f}_{}_ms", p, key)] = ms(percentile(*v, p));
    }
    j["bench"] = "serving";
    j["concurrency"] = a.max_concurrency;
    j["input_len"] = a.input_len;
    j["output_len"] = a.output_len;
    j["tok_s"] = out_tokens / duration;
    append_record(a.json_out, j, a.gpu);
  }
  return ok == a.num_requests ? 0 : 1;
}

}  // namespace

void register_bench_serving(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench-serving",
                                 "Load generator against a running server: throughput, TTFT and ITL percentiles");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--host", a->host, "server address")->capture_default_str();
  cmd->add_option("--port", a->port, "server port")->capture_default_str()->check(CLI::Range(1, 65535));
  cmd->add_option("--adapters", a->num_adapters, "how many of the server's adapters to spread requests over (default: all)")
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--adapter", a->adapters, "adapter (model name) to use instead (repeatable)");
  cmd->add_flag("--include-base", a->include_base, "send requests to the base model too");
  cmd->add_option("--num-requests,-n", a->num_requests, "requests to send")->capture_default_str()->check(CLI::Range(1, 10000000));
  cmd->add_option("--request-rate", a->request_rate, "requests per second, Poisson arrivals (0: all at once)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--max-concurrency", a->max_concurrency, "requests in flight at most (0: as many as arrive, up to 1024)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--input-len", a->input_len, "prompt tokens per request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--output-len", a->output_len, "generated tokens per request")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", a->temperature, "sampling temperature (0: greedy)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "seed for prompts and sampling")->capture_default_str();
  cmd->add_option("--endpoint", a->endpoint, "/v1/completions, or /v1/chat/completions (chat bodies)")
      ->capture_default_str();
  cmd->add_option("--api-key", a->api_key, "the server's API key (sent as Authorization: Bearer)");
  cmd->add_option("--json", a->json_out, "append the results as one JSON line (a bench record) to this file");
  cmd->add_option("--gpu", a->gpu, "the server's GPU, written into the JSON record");
  cmd->add_option("--timeout", a->timeout_s, "seconds a request may take")->capture_default_str();
  cmd->callback([a, &exit_code] { exit_code = run_bench(*a); });
}

}  // namespace moelora::tools
