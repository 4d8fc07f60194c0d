// One OpenAI request in flight: its choices submitted to the engine, their outputs turned into
// text (incremental detokenization, stop strings, logprobs) and into SSE chunks or one JSON
// response. Runs on the HTTP thread that answers the request; the engine reaches it only
// through the RequestChannel. Destroying a job cancels whatever the engine still runs for it,
// so a client that goes away (whatever the path out of the handler) frees its KV pages and slot.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/openai_protocol.h"
#include "server/openai_responses.h"
#include "server/request_channel.h"
#include "server/stop_strings.h"
#include "server/tool_calls.h"

namespace moelora {
class StreamDecoder;
}

namespace moelora::server {

class ServingTokenizer;

struct JobSpec {
  ResponseHeader header;
  std::string engine_id;                       // unique among live requests (X-Request-Id need not be)
  std::string adapter;                         // "" = base model
  std::vector<std::vector<int32_t>> prompts;   // tokenized
  std::vector<std::string> echo_text;          // per prompt; empty unless echo
  GenerationOptions opts;
  int max_model_len = 0;
  Clock::time_point arrival;
  ToolCallFormat tool_format = ToolCallFormat::kNone;  // chat with tools: parse the output's calls
};

class GenerationJob {
 public:
  // Validates lengths and submits every choice; on failure nothing stays submitted.
  static std::shared_ptr<GenerationJob> start(JobSpec spec, Engine& engine, const ServingTokenizer& tokenizer,
                                              ServerMetrics* metrics, ApiError* error);
  ~GenerationJob();
  GenerationJob(const GenerationJob&) = delete;
  GenerationJob& operator=(const GenerationJob&) = delete;

  // Waits up to `timeout` for engine output and processes it. When streaming, the SSE frames
  // to send are appended to `sse` (the first call also emits the opening chunks). Returns true
  // once the job is complete (streaming: `sse` then ends with data: [DONE]).
  bool pump(std::chrono::milliseconds timeout, std::string* sse);
  bool complete() const { return complete_; }

  // Non-streaming: the HTTP status and body once complete().
  int final_status() const;
  std::string final_body() const;

  // The client is gone: stop everything still running.
  void cancel();

  const JobSpec& spec() const { return spec_; }
  // Wakes the HTTP session when output arrives (see RequestChannel::set_listener).
  void set_listener(std::function<void()> listener) { channel_->set_listener(std::move(listener)); }
  UsageCounts usage() const;
  double first_token_seconds() const { return channel_->first_token_seconds(); }
  // For the request log: the finish reasons of the choices ("stop", "length", "stop,length"),
  // "error", or "abort" when the job never completed (client gone, server stopping).
  std::string outcome() const;

 private:
  struct Choice {
    int index = 0;
    int prompt = 0;
    std::string engine_id;
    std::unique_ptr<StreamDecoder> decoder;
    std::unique_ptr<ToolCallStreamParser> tool_parser;  // streaming with tools
    StopStringMatcher stop{{}, false};
    bool done = false;         // finished as the API sees it
    bool engine_done = false;  // the engine reported its end
    std::string finish_reason;
    OJson stop_reason;
    std::string text;          // all text so far (non-streaming response, text offsets)
    std::vector<int32_t> token_ids;
    int completion_tokens = 0;
    int cached_tokens = 0;
    LogprobsBuilder logprobs_delta{ApiKind::kCompletion};
    LogprobsBuilder logprobs_all{ApiKind::kCompletion};
    size_t token_ids_sent = 0;
  };

  GenerationJob(JobSpec spec, Engine& engine, const ServingTokenizer& tokenizer, ServerMetrics* metrics);
  // Applies one delivery; returns the text it adds to the choice (already stop-filtered).
  std::string apply(Choice& c, ChoiceDelivery& d);
  void fail(ApiError error);
  void finish_stream(std::string* sse);
  std::vector<ChoiceOutput> opening_chunks();

  JobSpec spec_;
  Engine& engine_;
  const ServingTokenizer& tokenizer_;
  std::shared_ptr<RequestChannel> channel_;
  std::vector<Choice> choices_;
  std::vector<ChoiceDelivery> scratch_;
  bool opened_ = false;
  bool complete_ = false;
  bool failed_ = false;
  ApiError error_;
};

// Owns a running job for as long as its HTTP response exists, whatever ends it (finished,
// client gone, server stopping): dropping the lease cancels what still runs in the engine,
// gives back the open-request slot (ServerMetrics::try_start_http_request) and writes the
// request's log line.
class GenerationLease {
 public:
  GenerationLease(std::shared_ptr<GenerationJob> job, ServerMetrics* metrics, std::string request_id);
  ~GenerationLease();
  GenerationLease(const GenerationLease&) = delete;
  GenerationLease& operator=(const GenerationLease&) = delete;
  GenerationJob& job() { return *job_; }
  void set_http_status(int status) { http_status_ = status; }

 private:
  std::shared_ptr<GenerationJob> job_;
  ServerMetrics* metrics_;
  std::string request_id_;
  int http_status_ = 0;
};

// A fresh id: prefix + 24 hex digits.
std::string make_response_id(const char* prefix);

}  // namespace moelora::server
