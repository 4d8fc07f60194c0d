// The Prometheus exposition: vLLM's names, well-formed histograms, label escaping.
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "server/metrics.h"

namespace moelora::server {
namespace {

EngineStats sample_stats() {
  EngineStats s;
  s.num_running = 3;
  s.num_waiting = 2;
  s.kv_pages_total = 100;
  s.kv_pages_used = 25;
  s.kv_pages_cached = 5;
  s.lora_slots_total = 4;
  s.lora_slots_used = 2;
  s.penalty_slots_total = 16;
  s.penalty_slots_used = 3;
  s.running_adapters = {"sql", "chat"};
  s.waiting_adapters = {"legal"};
  s.prompt_tokens_total = 1000;
  s.generation_tokens_total = 500;
  s.num_preemptions_total = 7;
  s.prefix_cache_queries_total = 1000;
  s.prefix_cache_hits_total = 320;
  return s;
}

TEST(ServerMetrics, VllmNamesAndValues) {
  ServerMetrics m("tiny", 4);
  m.observe_time_to_first_token(0.03);
  m.observe_inter_token_latency(0.004);
  m.observe_finished(RequestOutcome::kStop, 0.5, 10, 20);
  m.observe_finished(RequestOutcome::kAbort, 0.1, 10, 2);
  const std::string t = m.render(sample_stats(), 3, 1.5e9);
  for (const char* line : {
           "vllm:num_requests_running{model_name=\"tiny\"} 3",
           "vllm:num_requests_waiting{model_name=\"tiny\"} 2",
           "vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.25",
           "vllm:lora_requests_info{model_name=\"tiny\",max_lora=\"4\",running_lora_adapters=\"sql,chat\","
           "waiting_lora_adapters=\"legal\"} 1500000000",
           "vllm:prompt_tokens_total{model_name=\"tiny\"} 1000",
           "vllm:generation_tokens_total{model_name=\"tiny\"} 500",
           "vllm:num_preemptions_total{model_name=\"tiny\"} 7",
           "vllm:prefix_cache_queries_total{model_name=\"tiny\"} 1000",
           "vllm:prefix_cache_hits_total{model_name=\"tiny\"} 320",
           "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"stop\"} 1",
           "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"abort\"} 1",
           "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 0",
           "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.04\"} 1",
           "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.02\"} 0",
           "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"+Inf\"} 1",
           "vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 1",
           "vllm:inter_token_latency_seconds_count{model_name=\"tiny\"} 1",
           "vllm:time_per_output_token_seconds_count{model_name=\"tiny\"} 1",
           "vllm:e2e_request_latency_seconds_count{model_name=\"tiny\"} 2",
           "moelora_kv_pages_used{model_name=\"tiny\"} 25",
           "moelora_lora_slots_used{model_name=\"tiny\"} 2",
           "moelora_penalty_slots_total{model_name=\"tiny\"} 16",
           "moelora_penalty_slots_used{model_name=\"tiny\"} 3",
           "moelora_lora_adapters_loaded{model_name=\"tiny\"} 3",
       })
    EXPECT_NE(t.find(std::string(line) + "\n"), std::string::npos) << line << "\n---\n" << t;
}

TEST(ServerMetrics, WellFormedExposition) {
  ServerMetrics m("a \"quoted\"\\name", 1);
  m.observe_time_to_first_token(100.0);
  const std::string t = m.render(sample_stats(), 0, 1);
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.back(), '\n');
  EXPECT_NE(t.find("model_name=\"a \\\"quoted\\\"\\\\name\""), std::string::npos);
  // Every sample line: name{labels} value; every family has one HELP and one TYPE.
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*\{([a-zA-Z_]+="([^"\\]|\\.)*",?)*\} [-+0-9.eEInfa]+$)");
  std::istringstream in(t);
  std::string line;
  std::map<std::string, int> types;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      types[line.substr(7, line.find(' ', 7) - 7)]++;
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
  }
  for (const auto& [name, n] : types) EXPECT_EQ(n, 1) << name;
  // Buckets are cumulative and end at the count.
  EXPECT_NE(t.find("vllm:time_to_first_token_seconds_bucket{model_name=\"a \\\"quoted\\\"\\\\name\",le=\"80\"} 0"),
            std::string::npos);
  EXPECT_NE(t.find("vllm:time_to_first_token_seconds_bucket{model_name=\"a \\\"quoted\\\"\\\\name\",le=\"160\"} 1"),
            std::string::npos);
}

TEST(ServerMetrics, HistogramSnapshot) {
  Histogram h({1, 2, 3});
  for (double v : {0.5, 1.0, 1.5, 2.5, 10.0}) h.observe(v);
  const auto s = h.snapshot();
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{2, 3, 4, 5}));
  EXPECT_EQ(s.count, 5u);
  EXPECT_DOUBLE_EQ(s.sum, 15.5);
}

}  // namespace
}  // namespace moelora::server
