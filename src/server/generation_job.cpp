#include "server/generation_job.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>

#include "core/log.h"
#include "server/serving_tokenizer.h"
#include "server/sse.h"
#include "tokenizer/stream_decoder.h"

namespace moelora::server {

std::string make_response_id(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), static_cast<uint32_t>(rng()));
}

GenerationJob::GenerationJob(JobSpec spec, Engine& engine, const ServingTokenizer& tokenizer, ServerMetrics* metrics)
    : spec_(std::move(spec)), engine_(engine), tokenizer_(tokenizer) {
  const int n = spec_.opts.n;
  const int total = static_cast<int>(spec_.prompts.size()) * n;
  channel_ = std::make_shared<RequestChannel>(total, spec_.arrival, metrics);
  choices_.resize(total);
  for (int i = 0; i < total; ++i) {
    Choice& c = choices_[i];
    c.index = i;
    c.prompt = i / n;
    c.engine_id = fmt::format("{}-{}", spec_.engine_id, i);
    c.decoder = tokenizer_.stream_decoder(spec_.opts.skip_special_tokens);
    if (spec_.tool_format != ToolCallFormat::kNone && spec_.opts.stream)
      c.tool_parser = std::make_unique<ToolCallStreamParser>(spec_.tool_format);
    c.stop = StopStringMatcher(spec_.opts.stop, spec_.opts.include_stop_str_in_output);
    c.logprobs_delta = LogprobsBuilder(spec_.header.kind);
    c.logprobs_all = LogprobsBuilder(spec_.header.kind);
  }
}

std::shared_ptr<GenerationJob> GenerationJob::start(JobSpec spec, Engine& engine, const ServingTokenizer& tokenizer,
                                                    ServerMetrics* metrics, ApiError* error) {
  const int max_len = spec.max_model_len;
  if (spec.engine_id.empty()) spec.engine_id = make_response_id("req-");
  if (const auto k = spec.opts.truncate_prompt_tokens) {
    // vLLM: keep the last k tokens (-1: the context length); k beyond the context is an error.
    if (*k > max_len) {
      *error = bad_request(fmt::format("'truncate_prompt_tokens' ({}) is greater than the context length ({})", *k,
                                       max_len),
                           "truncate_prompt_tokens");
      return nullptr;
    }
    const size_t keep = static_cast<size_t>(*k == -1 ? max_len : *k);
    for (auto& prompt : spec.prompts)
      if (prompt.size() > keep) prompt.erase(prompt.begin(), prompt.end() - static_cast<long>(keep));
  }
  std::vector<SamplingParams> per_prompt;
  for (size_t p = 0; p < spec.prompts.size(); ++p) {
    const int len = static_cast<int>(spec.prompts[p].size());
    if (len == 0) {
      *error = bad_request("the prompt is empty", spec.header.kind == ApiKind::kChat ? "messages" : "prompt");
      return nullptr;
    }
    if (len >= max_len) {
      *error = prompt_too_long_error(max_len, len);
      return nullptr;
    }
    SamplingParams s = spec.opts.sampling;
    // The tokenizer's end-of-turn tokens end generation too (unless ignore_eos), without being
    // reported as the client's stop_token_ids.
    if (!s.ignore_eos)
      for (int32_t id : tokenizer.eos_token_ids())
        if (std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), id) == s.stop_token_ids.end())
          s.stop_token_ids.push_back(id);
    if (!spec.opts.max_tokens_given) s.max_tokens = max_len - len;  // chat without max_tokens: fill the context
    if (len + s.max_tokens > max_len) {
      *error = context_length_error(max_len, len, s.max_tokens);
      return nullptr;
    }
    if (s.min_tokens > s.max_tokens) {
      *error = bad_request(fmt::format("'min_tokens' must be <= max_tokens = {}, got {}", s.max_tokens, s.min_tokens),
                           "min_tokens");
      return nullptr;
    }
    per_prompt.push_back(s);
  }
  std::shared_ptr<GenerationJob> job(new GenerationJob(std::move(spec), engine, tokenizer, metrics));
  const int n = job->spec_.opts.n;
  for (Choice& c : job->choices_) {
    GenerationRequest req;
    req.id = c.engine_id;
    req.prompt = job->spec_.prompts[c.prompt];
    req.adapter = job->spec_.adapter;
    req.cache_salt = job->spec_.opts.cache_salt;
    req.sampling = per_prompt[c.prompt];
    // Seeded requests: choice i of a prompt uses seed + i, so the n choices differ but each
    // one is reproducible on its own.
    if (req.sampling.seed) *req.sampling.seed += static_cast<uint64_t>(c.index % n);
    std::shared_ptr<RequestChannel> ch = job->channel_;
    const int index = c.index;
    Status st = engine.submit(std::move(req), [ch, index](const RequestOutput& o) { ch->deliver(index, o); });
    if (!st.ok()) {
      *error = from_status(st, st.code() == ErrorCode::kNotFound ? "model" : "");
      if (st.code() == ErrorCode::kNotFound) *error = model_not_found(job->spec_.header.model);
      c.engine_done = true;  // never submitted
      for (Choice& other : job->choices_)
        if (&other != &c && !other.engine_done) engine.cancel(other.engine_id);
      for (Choice& other : job->choices_) other.engine_done = true;
      return nullptr;
    }
  }
  return job;
}

GenerationJob::~GenerationJob() { cancel(); }

void GenerationJob::cancel() {
  for (Choice& c : choices_)
    if (!c.engine_done) {
      engine_.cancel(c.engine_id);
      c.engine_done = true;
    }
}

void GenerationJob::fail(ApiError error) {
  if (failed_) return;
  failed_ = true;
  error_ = std::move(error);
  cancel();
  for (Choice& c : choices_) c.done = true;
}

std::string GenerationJob::apply(Choice& c, ChoiceDelivery& d) {
  std::string delta;
  if (d.finished) c.engine_done = true;
  if (c.done) return delta;
  const bool want_lp = spec_.opts.want_logprobs;
  for (size_t k = 0; k < d.tokens.size(); ++k) {
    const TokenEvent& t = d.tokens[k];
    const bool stop_token = d.finished && d.reason == FinishReason::kStop && k + 1 == d.tokens.size();
    c.completion_tokens++;
    c.token_ids.push_back(t.token);
    std::string piece;
    if (c.decoder && !(stop_token && !spec_.opts.include_stop_str_in_output)) piece = c.decoder->push(t.token);
    if (want_lp) {
      std::vector<std::pair<std::string, float>> top;
      for (const auto& [id, lp] : t.top_logprobs) top.emplace_back(tokenizer_.token_bytes(id), lp);
      const int offset = static_cast<int>(c.text.size() + delta.size());
      c.logprobs_delta.add(tokenizer_.token_bytes(t.token), t.logprob, top, offset);
      c.logprobs_all.add(tokenizer_.token_bytes(t.token), t.logprob, top, offset);
    }
    StopStringMatcher::Output r = c.stop.feed(piece);
    delta += r.text;
    if (r.stopped) {
      c.done = true;
      c.finish_reason = "stop";
      c.stop_reason = r.matched;
      channel_->set_outcome_override(c.index, RequestOutcome::kStop);
      if (!c.engine_done) {
        engine_.cancel(c.engine_id);
        c.engine_done = true;
      }
      break;
    }
  }
  c.cached_tokens = d.cached_tokens;
  if (!c.done && d.finished) {
    switch (d.reason) {
      case FinishReason::kStop:
      case FinishReason::kLength: {
        StopStringMatcher::Output r = c.stop.feed(c.decoder ? c.decoder->finish() : std::string());
        delta += r.text;
        if (r.stopped) {
          c.finish_reason = "stop";
          c.stop_reason = r.matched;
        } else {
          delta += c.stop.flush();
          c.finish_reason = d.reason == FinishReason::kStop ? "stop" : "length";
          c.stop_reason = nullptr;
          if (d.reason == FinishReason::kStop && !c.token_ids.empty()) {
            const auto& ids = spec_.opts.sampling.stop_token_ids;
            if (std::find(ids.begin(), ids.end(), c.token_ids.back()) != ids.end()) c.stop_reason = c.token_ids.back();
          }
        }
        c.done = true;
        break;
      }
      case FinishReason::kCancelled:
        fail({503, "ServiceUnavailableError", "the request was cancelled: the server is shutting down", ""});
        break;
      default:
        fail(d.error.ok() ? internal_error("generation failed") : from_status(d.error));
        break;
    }
  }
  c.text += delta;
  return delta;
}

UsageCounts GenerationJob::usage() const {
  UsageCounts u;
  const int n = spec_.opts.n;
  for (size_t p = 0; p < spec_.prompts.size(); ++p) {
    u.prompt_tokens += static_cast<int>(spec_.prompts[p].size());
    u.cached_tokens += choices_[p * n].cached_tokens;
  }
  for (const Choice& c : choices_) u.completion_tokens += c.completion_tokens;
  return u;
}

std::vector<ChoiceOutput> GenerationJob::opening_chunks() {
  // Chat streams announce the role first; completions with echo start with the prompt.
  std::vector<ChoiceOutput> out;
  for (const Choice& c : choices_) {
    ChoiceOutput o;
    o.index = c.index;
    if (spec_.header.kind == ApiKind::kChat) o.role = true;
    else if (!spec_.echo_text.empty() && !spec_.echo_text[c.prompt].empty()) o.text = spec_.echo_text[c.prompt];
    else continue;
    out.push_back(std::move(o));
  }
  return out;
}

void GenerationJob::finish_stream(std::string* sse) {
  if (failed_) {
    *sse += sse_data(error_.to_json());
  } else if (spec_.opts.include_usage) {
    *sse += sse_data(usage_chunk_json(spec_.header, usage()));
  }
  *sse += sse_done();
  complete_ = true;
}

bool GenerationJob::pump(std::chrono::milliseconds timeout, std::string* sse) {
  if (complete_) return true;
  const bool streaming = spec_.opts.stream;
  if (streaming && !opened_) {
    opened_ = true;
    std::vector<ChoiceOutput> open = opening_chunks();
    const std::optional<OJson> usage_field =
        spec_.opts.include_usage ? std::optional<OJson>(OJson(nullptr)) : std::nullopt;
    for (ChoiceOutput& o : open) *sse += sse_data(chunk_json(spec_.header, {o}, usage_field));
  }
  if (channel_->wait_take(timeout, &scratch_)) {
    for (size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = choices_[i];
      ChoiceDelivery& d = scratch_[i];
      if (d.tokens.empty() && !d.finished) continue;
      const bool was_done = c.done;
      std::string delta = apply(c, d);
      if (failed_) break;
      if (!streaming || was_done) continue;
      ChoiceOutput o;
      o.index = c.index;
      o.text = std::move(delta);
      if (c.tool_parser) {
        // Text becomes content and tool-call deltas; the end settles what was held back.
        ToolCallStreamParser::Delta td = c.tool_parser->feed(o.text);
        if (c.done) {
          ToolCallStreamParser::Delta end = c.tool_parser->finish();
          td.content += end.content;
          for (auto& call : end.tool_calls) td.tool_calls.push_back(std::move(call));
          if (c.tool_parser->called() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
        }
        o.text = std::move(td.content);
        if (!td.tool_calls.empty()) o.tool_calls = std::move(td.tool_calls);
      }
      if (!c.logprobs_delta.empty()) o.logprobs = c.logprobs_delta.take();
      if (c.done) {
        o.finish_reason = c.finish_reason;
        o.stop_reason = c.stop_reason;
      }
      if (spec_.opts.return_token_ids) {
        o.token_ids = std::vector<int32_t>(c.token_ids.begin() + static_cast<long>(c.token_ids_sent), c.token_ids.end());
        c.token_ids_sent = c.token_ids.size();
      }
      if (o.text.empty() && !o.logprobs && !o.finish_reason && !(o.token_ids && !o.token_ids->empty()) &&
          !o.tool_calls)
        continue;
      std::optional<OJson> usage_field;
      if (spec_.opts.continuous_usage_stats) usage_field = usage_json(usage());
      else if (spec_.opts.include_usage) usage_field = OJson(nullptr);
      *sse += sse_data(chunk_json(spec_.header, {o}, usage_field));
    }
  }
  const bool all_done = failed_ || std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return c.done; });
  if (!all_done) return false;
  if (streaming) finish_stream(sse);
  complete_ = true;
  return true;
}

std::string GenerationJob::outcome() const {
  if (failed_) return "error";
  if (!complete_) return "abort";
  std::string out;
  for (const Choice& c : choices_)
    if (out.find(c.finish_reason) == std::string::npos) out += (out.empty() ? "" : ",") + c.finish_reason;
  return out;
}

GenerationLease::GenerationLease(std::shared_ptr<GenerationJob> job, ServerMetrics* metrics, std::string request_id)
    : job_(std::move(job)), metrics_(metrics), request_id_(std::move(request_id)) {}

GenerationLease::~GenerationLease() {
  job_->set_listener(nullptr);
  job_->cancel();
  metrics_->http_request_ended();
  const JobSpec& s = job_->spec();
  const UsageCounts u = job_->usage();
  const double total = std::chrono::duration<double>(Clock::now() - s.arrival).count();
  const double ttft = job_->first_token_seconds();
  // One line per finished request (vLLM logs the same facts): enough to find a slow or failed
  // request by its X-Request-Id without turning on debug logging.
  MOELORA_LOG_INFO("request {} ({}): adapter={} prompt_tokens={} completion_tokens={} cached_tokens={} ttft={} "
                   "total={:.3f}s finish={} status={}",
                   request_id_, s.header.id, s.adapter.empty() ? "-" : s.adapter, u.prompt_tokens, u.completion_tokens,
                   u.cached_tokens, ttft < 0 ? std::string("-") : fmt::format("{:.3f}s", ttft), total,
                   job_->outcome(), http_status_ == 0 ? std::string("-") : std::to_string(http_status_));
}

int GenerationJob::final_status() const { return failed_ ? error_.http_status : 200; }

std::string GenerationJob::final_body() const {
  if (failed_) return error_.body();
  std::vector<ChoiceOutput> out;
  for (const Choice& c : choices_) {
    ChoiceOutput o;
    o.index = c.index;
    o.text = c.text;
    if (!spec_.echo_text.empty()) o.text = spec_.echo_text[c.prompt] + o.text;
    if (spec_.opts.want_logprobs) o.logprobs = LogprobsBuilder(c.logprobs_all).take();
    o.finish_reason = c.finish_reason;
    o.stop_reason = c.stop_reason;
    if (spec_.tool_format != ToolCallFormat::kNone) {
      // Malformed calls leave the text as content (parse_tool_calls never fails).
      ParsedToolCalls parsed = parse_tool_calls(spec_.tool_format, o.text);
      if (!parsed.calls.empty()) {
        o.text = std::move(parsed.content);
        o.tool_calls = tool_calls_json(parsed.calls);
        if (o.finish_reason == "stop") o.finish_reason = "tool_calls";
      }
    }
    if (spec_.opts.return_token_ids) {
      o.token_ids = c.token_ids;
      o.prompt_token_ids = spec_.prompts[c.prompt];
    }
    out.push_back(std::move(o));
  }
  return dump_json(response_json(spec_.header, out, usage()));
}

}  // namespace moelora::server
