// POST /v1/completions and /v1/chat/completions: parse, resolve the model, tokenize, start a
// GenerationJob, then answer with one JSON object or an SSE stream.
#include <httplib.h>

#include <fmt/format.h>

#include "server/generation_job.h"
#include "server/server_state.h"
#include "server/sse.h"

namespace moelora::server {

namespace {

constexpr int kThreadsReservedForControl = 16;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Owns a running job for as long as its HTTP response exists, whatever ends it (finished,
// client gone, server stopping): dropping the lease cancels what still runs in the engine.
struct JobLease {
  std::shared_ptr<GenerationJob> job;
  ServerMetrics* metrics;
  JobLease(std::shared_ptr<GenerationJob> j, ServerMetrics* m) : job(std::move(j)), metrics(m) {
    metrics->http_request_started();
  }
  ~JobLease() {
    job->cancel();
    metrics->http_request_ended();
  }
};

void answer_stream(ServerState& st, std::shared_ptr<GenerationJob> job, httplib::Response& res) {
  auto lease = std::make_shared<JobLease>(std::move(job), &st.metrics);
  const auto heartbeat = st.options.heartbeat;
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies must not buffer the stream
  auto last_write = std::make_shared<Clock::time_point>(Clock::now());
  res.set_chunked_content_provider(
      std::string(kSseContentType),
      [lease, heartbeat, last_write](size_t, httplib::DataSink& sink) {
        std::string out;
        const bool done = lease->job->pump(heartbeat, &out);
        // Nothing to say for a while: a comment line probes the connection, so a client that
        // went away is noticed (cpp-httplib sees a disconnect only when a write fails).
        if (out.empty() && !done && Clock::now() - *last_write >= heartbeat) out = sse_comment("keep-alive");
        if (!out.empty()) {
          if (!sink.write(out.data(), out.size())) {
            lease->job->cancel();
            return false;
          }
          *last_write = Clock::now();
        }
        if (done) sink.done();
        return true;
      },
      [lease](bool) { lease->job->cancel(); });
}

void answer_whole(ServerState& st, std::shared_ptr<GenerationJob> job, httplib::Response& res) {
  auto lease = std::make_shared<JobLease>(std::move(job), &st.metrics);
  GenerationJob& j = *lease->job;
  const auto probe_at = Clock::now() + st.options.nonstream_probe_after;
  std::string unused;
  while (!j.pump(std::chrono::milliseconds(50), &unused) && Clock::now() < probe_at) {
  }
  if (j.complete()) {
    if (j.final_status() != 200) st.metrics.count_rejected(j.final_status());
    res.status = j.final_status();
    res.set_content(j.final_body(), "application/json");
    return;
  }
  // A long generation: the status is committed now (200) and the body is streamed as
  // whitespace (valid before JSON) until the object is ready, so that a client that gives up
  // is noticed on a write and its request cancelled instead of running to max_tokens.
  const auto heartbeat = st.options.heartbeat;
  res.status = 200;
  res.set_chunked_content_provider(
      "application/json",
      [lease, heartbeat](size_t, httplib::DataSink& sink) {
        std::string unused_sse;
        if (lease->job->pump(heartbeat, &unused_sse)) {
          const std::string body = lease->job->final_body();
          if (!sink.write(body.data(), body.size())) return false;
          sink.done();
          return true;
        }
        if (!sink.write(" ", 1)) {
          lease->job->cancel();
          return false;
        }
        return true;
      },
      [lease](bool) { lease->job->cancel(); });
}

// Common tail of both endpoints: start the job and answer.
void run(ServerState& st, JobSpec spec, httplib::Response& res) {
  const bool stream = spec.opts.stream;
  // Every open generation response holds an HTTP thread; past this many, new ones are turned
  // away so that threads stay free for /health, /metrics and adapter management.
  const int limit = std::max(1, st.options.http_threads - kThreadsReservedForControl);
  if (st.metrics.http_requests_active() >= limit)
    return st.send_error(res, {503, "ServiceUnavailableError",
                               fmt::format("the server is at its limit of {} open generation requests", limit), ""});
  ApiError err;
  std::shared_ptr<GenerationJob> job = GenerationJob::start(std::move(spec), st.engine, *st.tokenizer, &st.metrics, &err);
  if (!job) return st.send_error(res, err);
  if (stream) answer_stream(st, std::move(job), res);
  else answer_whole(st, std::move(job), res);
}

bool refuse_if_draining(ServerState& st, httplib::Response& res) {
  if (!st.draining.load()) return false;
  st.send_error(res, {503, "ServiceUnavailableError", "the server is shutting down", ""});
  return true;
}

void handle_completions(ServerState& st, const httplib::Request& req, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  if (refuse_if_draining(st, res)) return;
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  CompletionRequest r;
  if (auto e = parse_completion_request(body, st.options.limits, &r)) return st.send_error(res, *e);
  JobSpec spec;
  if (auto e = st.resolve_model(r.opts.model, r.opts.lora_path, &spec.adapter)) return st.send_error(res, *e);
  for (const PromptInput& p : r.prompts) {
    if (p.is_ids) {
      spec.prompts.push_back(p.ids);
      if (r.echo) spec.echo_text.push_back(st.tokenizer->decode(p.ids, /*skip_special_tokens=*/false));
      continue;
    }
    // Completions add the tokenizer's special tokens (BOS) as vLLM does by default.
    auto ids = st.tokenizer->encode(p.text, /*add_special_tokens=*/true);
    if (!ids.ok()) return st.send_error(res, from_status(ids.status(), "prompt"));
    spec.prompts.push_back(std::move(ids).value());
    if (r.echo) spec.echo_text.push_back(p.text);
  }
  spec.header = {ApiKind::kCompletion, make_response_id("cmpl-"), r.opts.model.empty() ? st.options.served_model_name
                                                                                         : r.opts.model,
                 unix_now()};
  spec.opts = std::move(r.opts);
  spec.max_model_len = st.engine.max_model_len();
  spec.arrival = arrival;
  run(st, std::move(spec), res);
}

void handle_chat(ServerState& st, const httplib::Request& req, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  if (refuse_if_draining(st, res)) return;
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  ChatCompletionRequest r;
  if (auto e = parse_chat_completion_request(body, st.options.limits, &r)) return st.send_error(res, *e);
  JobSpec spec;
  if (auto e = st.resolve_model(r.opts.model, r.opts.lora_path, &spec.adapter)) return st.send_error(res, *e);
  auto ids = st.tokenizer->encode_chat(r.messages, r.add_generation_prompt, r.continue_final_message);
  if (!ids.ok()) return st.send_error(res, from_status(ids.status(), "messages"));
  spec.prompts.push_back(std::move(ids).value());
  spec.header = {ApiKind::kChat, make_response_id("chatcmpl-"),
                 r.opts.model.empty() ? st.options.served_model_name : r.opts.model, unix_now()};
  spec.opts = std::move(r.opts);
  spec.max_model_len = st.engine.max_model_len();
  spec.arrival = arrival;
  run(st, std::move(spec), res);
}

}  // namespace

void register_generation_routes(httplib::Server& http, ServerState& st) {
  http.Post("/v1/completions",
            [&st](const httplib::Request& req, httplib::Response& res) { handle_completions(st, req, res); });
  http.Post("/v1/chat/completions",
            [&st](const httplib::Request& req, httplib::Response& res) { handle_chat(st, req, res); });
}

}  // namespace moelora::server
