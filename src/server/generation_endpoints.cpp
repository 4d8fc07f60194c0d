// POST /v1/completions and /v1/chat/completions: parse, resolve the model, tokenize, start a
// GenerationJob, and hand it to the HTTP session (http_session.cpp), which answers with an SSE
// stream or, once the job is finished, one JSON object with the status the outcome calls for.
#include <fmt/format.h>

#include "server/generation_job.h"
#include "server/server_state.h"
#include "server/sse.h"

namespace moelora::server {

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The response id, as vLLM builds it: X-Request-Id, else the body's request_id, else random.
std::string response_id(const char* prefix, const HttpRequest& req, const GenerationOptions& opts) {
  if (req.has_header("x-request-id") && !req.request_id.empty()) return prefix + req.request_id;
  if (opts.request_id && !opts.request_id->empty()) return prefix + *opts.request_id;
  return make_response_id(prefix);
}

// bad_words are strings in the request; the engine bans token sequences.
std::optional<ApiError> resolve_bad_words(const ServerState& st, GenerationOptions& opts) {
  if (opts.bad_words.empty()) return std::nullopt;
  if (!st.tokenizer->has_tokenizer())
    return bad_request("'bad_words' needs the model's tokenizer.json, which this model folder lacks", "bad_words");
  const ServingTokenizer& tok = *st.tokenizer;
  return tokenize_bad_words(
      opts.bad_words, [&](const std::string& text) { return tok.encode(text, /*add_special_tokens=*/false); },
      st.options.limits.vocab_size, &opts.sampling.bad_words);
}

// Common tail of both endpoints: start the job and give it to the session.
void run(ServerState& st, const HttpRequest& req, JobSpec spec, HttpResponse& res) {
  // Open generation responses are bounded exactly (a compare-and-swap takes the place), so a
  // burst of clients cannot push the server past --max-open-requests between check and start.
  const int limit = std::max(1, st.options.max_open_requests);
  if (!st.metrics.try_start_http_request(limit))
    return st.send_error(res, {503, "ServiceUnavailableError",
                               fmt::format("the server is at its limit of {} open generation requests", limit), ""});
  ApiError err;
  std::shared_ptr<GenerationJob> job = GenerationJob::start(std::move(spec), st.engine(), *st.tokenizer, &st.metrics, &err);
  if (!job) {
    st.metrics.http_request_ended();
    return st.send_error(res, err);
  }
  res.status = 200;
  res.generation = std::make_shared<GenerationLease>(std::move(job), &st.metrics, req.request_id);
}

bool refuse_if_draining(ServerState& st, HttpResponse& res) {
  if (!st.draining.load()) return false;
  st.send_error(res, {503, "ServiceUnavailableError", "the server is shutting down", ""});
  return true;
}

void handle_completions(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  const Clock::time_point arrival = req.arrival;
  if (refuse_if_draining(st, res)) return;
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  CompletionRequest r;
  if (auto e = parse_completion_request(body, st.options.limits, &r)) return st.send_error(res, *e);
  JobSpec spec;
  if (auto e = st.resolve_model(r.opts.model, r.opts.lora_path, &spec.adapter)) return st.send_error(res, *e);
  if (auto e = resolve_bad_words(st, r.opts)) return st.send_error(res, *e);
  const bool add_special = r.opts.add_special_tokens.value_or(true);
  for (const PromptInput& p : r.prompts) {
    if (p.is_ids) {
      spec.prompts.push_back(p.ids);
      if (r.echo) spec.echo_text.push_back(st.tokenizer->decode(p.ids, /*skip_special_tokens=*/false));
      continue;
    }
    // Completions add the tokenizer's special tokens (BOS) as vLLM does by default.
    auto ids = st.tokenizer->encode(p.text, add_special);
    if (!ids.ok()) return st.send_error(res, from_status(ids.status(), "prompt"));
    spec.prompts.push_back(std::move(ids).value());
    if (r.echo) spec.echo_text.push_back(p.text);
  }
  spec.header = {ApiKind::kCompletion, response_id("cmpl-", req, r.opts),
                 r.opts.model.empty() ? st.options.served_model_name : r.opts.model, unix_now()};
  spec.opts = std::move(r.opts);
  spec.max_model_len = st.engine().max_model_len();
  spec.arrival = arrival;
  run(st, req, std::move(spec), res);
}

void handle_chat(ServerState& st, const HttpRequest& req, HttpResponse& res) {
  const Clock::time_point arrival = req.arrival;
  if (refuse_if_draining(st, res)) return;
  Json body;
  if (auto e = parse_json_body(req.body, &body)) return st.send_error(res, *e);
  ChatCompletionRequest r;
  if (auto e = parse_chat_completion_request(body, st.options.limits, &r)) return st.send_error(res, *e);
  JobSpec spec;
  if (auto e = st.resolve_model(r.opts.model, r.opts.lora_path, &spec.adapter)) return st.send_error(res, *e);
  if (auto e = resolve_bad_words(st, r.opts)) return st.send_error(res, *e);
  // The template sees tools and assistant tool_calls in the client's key order (tojson shows it).
  keep_client_key_order(req.body, &r.messages, &r.tools);
  auto ids = st.tokenizer->encode_chat(r.messages, r.add_generation_prompt, r.continue_final_message, r.tools);
  if (!ids.ok()) return st.send_error(res, from_status(ids.status(), "messages"));
  if (r.opts.add_special_tokens.value_or(false)) {
    // vLLM's add_special_tokens for chat: the template already wrote them, so this adds the
    // tokenizer's own (BOS) in front, as encoding the rendered text with them would.
    auto bos = st.tokenizer->encode("", /*add_special_tokens=*/true);
    if (bos.ok() && !bos->empty()) ids->insert(ids->begin(), bos->begin(), bos->end());
  }
  spec.prompts.push_back(std::move(ids).value());
  spec.header = {ApiKind::kChat, response_id("chatcmpl-", req, r.opts),
                 r.opts.model.empty() ? st.options.served_model_name : r.opts.model, unix_now()};
  if (!r.tools.is_null() && r.tool_choice != "none") {
    spec.tool_format = st.tokenizer->tool_call_format();
    // DeepSeek's and Mistral's call markers are special tokens: decode them so the parser sees them.
    if (tool_markers_are_special(spec.tool_format)) r.opts.skip_special_tokens = false;
  }
  spec.opts = std::move(r.opts);
  spec.max_model_len = st.engine().max_model_len();
  spec.arrival = arrival;
  run(st, req, std::move(spec), res);
}

}  // namespace

void register_generation_routes(Router& router) {
  router.add("POST", "/v1/completions", RouteKind::kApi, handle_completions);
  router.add("POST", "/v1/chat/completions", RouteKind::kApi, handle_chat);
}

}  // namespace moelora::server
