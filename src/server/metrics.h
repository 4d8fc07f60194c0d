// Prometheus metrics under vLLM's names (routers such as the Gateway API Inference Extension
// and existing Grafana dashboards read them), plus moelora_ gauges of the resources a request
// holds (KV pages, adapter slots, HTTP requests in flight) so that tests can assert that nothing
// leaks. Engine-side counters are read from Engine::stats() at scrape time; latencies are
// observed by the server as tokens reach it (on the engine thread, so they are not skewed by a
// slow client).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace moelora::server {

// A cumulative histogram with fixed upper bounds (+Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// The finished_reason label values of vllm:request_success_total.
enum class RequestOutcome { kStop, kLength, kAbort, kError };

class ServerMetrics {
 public:
  ServerMetrics(std::string model_name, int max_lora);

  void observe_time_to_first_token(double seconds) { ttft_.observe(seconds); }
  void observe_inter_token_latency(double seconds);
  void observe_finished(RequestOutcome outcome, double e2e_seconds, int prompt_tokens, int generation_tokens);
  // HTTP generation requests in flight (incremented when one starts, decremented when its
  // response is gone, whatever the reason).
  void http_request_started() { http_active_.fetch_add(1); }
  // Takes one of `limit` open-request places, or none when all are taken: a compare-and-swap,
  // so concurrent requests can never exceed the limit between a check and an increment.
  bool try_start_http_request(int limit) {
    int cur = http_active_.load();
    while (cur < limit)
      if (http_active_.compare_exchange_weak(cur, cur + 1)) return true;
    return false;
  }
  void http_request_ended() { http_active_.fetch_sub(1); }
  int http_requests_active() const { return http_active_.load(); }
  void count_rejected(int http_status);

  // The exposition text (format 0.0.4). `loaded_adapters` is the registry's size.
  std::string render(const EngineStats& stats, int loaded_adapters, double unix_time_now) const;

 private:
  std::string model_name_;
  int max_lora_;
  Histogram ttft_, itl_, tpot_, e2e_, prompt_tokens_, generation_tokens_;
  std::atomic<uint64_t> outcomes_[4] = {};
  std::atomic<int> http_active_{0};
  mutable std::mutex rejected_mu_;
  std::map<int, uint64_t> rejected_;  // by HTTP status
};

// Escapes a Prometheus label value (backslash, double quote, newline).
std::string escape_label_value(const std::string& value);

}  // namespace moelora::server
