// One OpenAI request in flight: its choices submitted to the engine, their outputs turned into
// text (incremental detokenization, stop strings, logprobs) and into SSE chunks or one JSON
// response. Runs on the HTTP thread that answers the request; the engine reaches it only
// through the RequestChannel. Destroying a job cancels whatever the engine still runs for it,
// so a client that goes away (whatever the path out of the handler) frees its KV pages and slot.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/openai_protocol.h"
#include "server/openai_responses.h"
#include "server/request_channel.h"
#include "server/stop_strings.h"

namespace moelora {
class StreamDecoder;
}

namespace moelora::server {

class ServingTokenizer;

struct JobSpec {
  ResponseHeader header;
  std::string adapter;                         // "" = base model
  std::vector<std::vector<int32_t>> prompts;   // tokenized
  std::vector<std::string> echo_text;          // per prompt; empty unless echo
  GenerationOptions opts;
  int max_model_len = 0;
  Clock::time_point arrival;
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

 private:
  struct Choice {
    int index = 0;
    int prompt = 0;
    std::string engine_id;
    std::unique_ptr<StreamDecoder> decoder;
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
  UsageCounts usage() const;
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

// A fresh id: prefix + 24 hex digits.
std::string make_response_id(const char* prefix);

}  // namespace moelora::server
