#include "server/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace moelora::server {

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double value) {
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  std::lock_guard<std::mutex> lk(mu_);
  counts_[b]++;
  sum_ += value;
  count_++;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  std::lock_guard<std::mutex> lk(mu_);
  s.bounds = bounds_;
  uint64_t acc = 0;
  for (uint64_t c : counts_) s.cumulative.push_back(acc += c);
  s.sum = sum_;
  s.count = count_;
  return s;
}

namespace {

// vLLM's buckets, with finer steps below 10 ms added where a small model on a fast backend
// lands (extra buckets keep every vLLM bound, so dashboards still line up).
std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
          20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}
std::vector<double> itl_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
          5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}
std::vector<double> e2e_buckets() {
  return {0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}
std::vector<double> token_count_buckets() {
  return {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};
}

const char* outcome_label(int i) {
  static const char* names[] = {"stop", "length", "abort", "error"};
  return names[i];
}

std::string num(double v) { return fmt::format("{}", v); }

class Writer {
 public:
  explicit Writer(std::string model_label) : labels_(std::move(model_label)) {}

  void family(const std::string& name, const char* type, const char* help) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void sample(const std::string& name, const std::string& extra_labels, const std::string& value) {
    out_ += fmt::format("{}{{{}{}{}}} {}\n", name, labels_, extra_labels.empty() ? "" : ",", extra_labels, value);
  }
  void gauge(const std::string& name, const char* help, double v) {
    family(name, "gauge", help);
    sample(name, "", num(v));
  }
  void counter(const std::string& name, const char* help, uint64_t v) {
    family(name, "counter", help);
    sample(name, "", std::to_string(v));
  }
  void histogram(const std::string& name, const char* help, const Histogram::Snapshot& s) {
    family(name, "histogram", help);
    for (size_t i = 0; i < s.bounds.size(); ++i)
      sample(name + "_bucket", fmt::format("le=\"{}\"", num(s.bounds[i])), std::to_string(s.cumulative[i]));
    sample(name + "_bucket", "le=\"+Inf\"", std::to_string(s.cumulative.back()));
    sample(name + "_sum", "", num(s.sum));
    sample(name + "_count", "", std::to_string(s.count));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string labels_;
  std::string out_;
};

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

}  // namespace

std::string escape_label_value(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

ServerMetrics::ServerMetrics(std::string model_name, int max_lora)
    : model_name_(std::move(model_name)), max_lora_(max_lora), ttft_(ttft_buckets()), itl_(itl_buckets()),
      tpot_(itl_buckets()), e2e_(e2e_buckets()), prompt_tokens_(token_count_buckets()),
      generation_tokens_(token_count_buckets()) {}

void ServerMetrics::observe_inter_token_latency(double seconds) {
  itl_.observe(seconds);
  tpot_.observe(seconds);  // the legacy name of the same measurement
}

void ServerMetrics::observe_finished(RequestOutcome outcome, double e2e_seconds, int prompt_tokens,
                                     int generation_tokens) {
  outcomes_[static_cast<int>(outcome)].fetch_add(1);
  e2e_.observe(e2e_seconds);
  prompt_tokens_.observe(prompt_tokens);
  generation_tokens_.observe(generation_tokens);
}

void ServerMetrics::count_rejected(int http_status) {
  std::lock_guard<std::mutex> lk(rejected_mu_);
  rejected_[http_status]++;
}

std::string ServerMetrics::render(const EngineStats& st, int loaded_adapters, double unix_time_now) const {
  Writer w(fmt::format("model_name=\"{}\"", escape_label_value(model_name_)));
  w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", st.num_running);
  w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.num_waiting);
  w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
          st.kv_pages_total > 0 ? static_cast<double>(st.kv_pages_used) / st.kv_pages_total : 0.0);
  w.family("vllm:lora_requests_info", "gauge", "Running stats on LoRA requests (value: wall-clock time).");
  w.sample("vllm:lora_requests_info",
           fmt::format("max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"", max_lora_,
                       escape_label_value(join(st.running_adapters)), escape_label_value(join(st.waiting_adapters))),
           num(unix_time_now));
  w.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.prompt_tokens_total);
  w.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", st.generation_tokens_total);
  w.counter("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
            st.num_preemptions_total);
  w.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
            st.prefix_cache_queries_total);
  w.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
            st.prefix_cache_hits_total);
  w.family("vllm:request_success_total", "counter", "Count of successfully processed requests.");
  for (int i = 0; i < 4; ++i)
    w.sample("vllm:request_success_total", fmt::format("finished_reason=\"{}\"", outcome_label(i)),
             std::to_string(outcomes_[i].load()));
  w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft_.snapshot());
  w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl_.snapshot());
  w.histogram("vllm:time_per_output_token_seconds",
              "Histogram of time per output token in seconds (legacy name of the inter-token latency).",
              tpot_.snapshot());
  w.histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
              e2e_.snapshot());
  w.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", prompt_tokens_.snapshot());
  w.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
              generation_tokens_.snapshot());

  w.gauge("moelora_kv_pages_total", "KV cache pages in the pool.", st.kv_pages_total);
  w.gauge("moelora_kv_pages_used", "KV cache pages referenced by requests (0 when idle: no leak).",
          st.kv_pages_used);
  w.gauge("moelora_kv_pages_cached", "KV cache pages held only by the prefix cache (reclaimable).",
          st.kv_pages_cached);
  w.gauge("moelora_lora_slots_total", "Adapter slots on the backend (--max-loras-per-batch).", st.lora_slots_total);
  w.gauge("moelora_lora_slots_used", "Adapter slots referenced by requests (0 when idle: no leak).",
          st.lora_slots_used);
  w.gauge("moelora_lora_slots_loading", "Adapter slots whose adapter is being copied in (off the engine thread).",
          st.lora_slots_loading);
  w.gauge("moelora_penalty_slots_total", "Penalty slots on the backend (--penalty-slots).", st.penalty_slots_total);
  w.gauge("moelora_penalty_slots_used",
          "Penalty slots held by penalised requests (0 when idle: no leak; the rest send their counts as edits).",
          st.penalty_slots_used);
  w.gauge("moelora_lora_adapters_loaded", "Adapters registered with the server.", loaded_adapters);
  w.counter("moelora_lora_loads_total", "Adapter placements into a slot that completed.", st.lora_loads_total);
  w.counter("moelora_lora_load_failures_total",
            "Adapter placements that failed (only the requests waiting for that adapter failed).",
            st.lora_load_failures_total);
  w.family("moelora_lora_load_seconds_total", "counter", "Time the placement worker spent on completed placements.");
  w.sample("moelora_lora_load_seconds_total", "", num(st.lora_load_seconds_total));
  w.counter("moelora_lora_load_bytes_total", "Device bytes copied by completed placements.", st.lora_load_bytes_total);
  w.gauge("moelora_http_requests_active", "Generation requests whose HTTP response is still open.",
          http_active_.load());
  w.counter("moelora_engine_steps_total", "Engine steps (forward passes) run.", st.steps_total);
  w.counter("moelora_requests_finished_total", "Requests the engine finished, for any reason.",
            st.requests_finished_total);
  {
    std::lock_guard<std::mutex> lk(rejected_mu_);
    w.family("moelora_http_errors_total", "counter", "Requests answered with an error status, by status.");
    for (const auto& [code, n] : rejected_) w.sample("moelora_http_errors_total", fmt::format("code=\"{}\"", code),
                                                     std::to_string(n));
  }
  return w.take();
}

}  // namespace moelora::server
