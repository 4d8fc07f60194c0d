#include "server/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace moelora::server {

namespace {

const Json* present(const Json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string shown(const Json& v) {
  std::string s = dump_json(v);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

ApiError type_error(const char* key, const char* expected, const Json& got) {
  return bad_request(fmt::format("'{}' must be {}, got {}", key, expected, shown(got)), key);
}

}  // namespace

std::optional<ApiError> read_opt_bool(const Json& obj, const char* key, std::optional<bool>* out) {
  const Json* v = present(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return type_error(key, "true or false", *v);
  *out = v->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> read_opt_int(const Json& obj, const char* key, std::optional<int64_t>* out) {
  const Json* v = present(obj, key);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return type_error(key, "an integer that fits in 64 bits", *v);
    *out = v->get<int64_t>();
    return std::nullopt;
  }
  if (v->is_number_float()) {
    // 5.0 is an integer in JSON's eyes (some clients serialise every number as a float).
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) {
      *out = static_cast<int64_t>(d);
      return std::nullopt;
    }
  }
  return type_error(key, "an integer", *v);
}

std::optional<ApiError> read_opt_number(const Json& obj, const char* key, std::optional<double>* out) {
  const Json* v = present(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return type_error(key, "a number", *v);
  *out = v->get<double>();
  return std::nullopt;
}

std::optional<ApiError> read_opt_string(const Json& obj, const char* key, std::optional<std::string>* out) {
  const Json* v = present(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) return type_error(key, "a string", *v);
  *out = v->get<std::string>();
  return std::nullopt;
}

std::optional<ApiError> read_token_ids(const Json& value, const char* param, std::vector<int32_t>* out) {
  if (!value.is_array()) return type_error(param, "an array of token ids", value);
  out->clear();
  out->reserve(value.size());
  for (const Json& t : value) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return bad_request(fmt::format("'{}' must hold non-negative integer token ids, got {}", param, shown(t)), param);
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_json_body(const std::string& body, Json* out) {
  if (body.empty()) return bad_request("the request body is empty; expected a JSON object");
  auto j = parse_json_strict(body, "the request body");
  if (!j.ok()) return bad_request(j.status().message());
  if (!j->is_object()) return bad_request("the request body must be a JSON object");
  *out = std::move(j).value();
  return std::nullopt;
}

ApiError context_length_error(int max_model_len, int prompt_tokens, int max_tokens) {
  return bad_request(fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                                 "({} in the messages, {} in the completion). Please reduce the length of the "
                                 "messages or completion.",
                                 max_model_len, prompt_tokens + max_tokens, prompt_tokens, max_tokens),
                     "max_tokens");
}

ApiError prompt_too_long_error(int max_model_len, int prompt_tokens) {
  return bad_request(fmt::format("This model's maximum context length is {} tokens. However, your request has {} "
                                 "input tokens. Please reduce the length of the input messages.",
                                 max_model_len, prompt_tokens),
                     "messages");
}

namespace {

#define MOELORA_TRY_API(expr)               \
  do {                                      \
    if (auto _api_err = (expr)) return _api_err; \
  } while (0)

// vLLM documents these fields; moelora does not implement what they ask for, so a request that
// sets them is refused (400 naming the field) rather than answered as if they were absent. A
// field counts as set when it is present, not null, and not its neutral value.
std::optional<ApiError> refuse_unsupported(const Json& b, bool chat) {
  auto set = [](const Json& v) {
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_array() || v.is_object() || v.is_string()) return !v.empty();
    return true;
  };
  struct Refused {
    const char* key;
    const char* why;
  };
  static const Refused kRefused[] = {
      {"prompt_logprobs", "prompt logprobs are not implemented"},
      {"use_beam_search", "beam search is not implemented"},
      {"guided_json", "guided decoding is not implemented"},
      {"guided_regex", "guided decoding is not implemented"},
      {"guided_choice", "guided decoding is not implemented"},
      {"guided_grammar", "guided decoding is not implemented"},
      {"guided_decoding_backend", "guided decoding is not implemented"},
      {"guided_whitespace_pattern", "guided decoding is not implemented"},
      {"structured_outputs", "structured outputs are not implemented"},
      {"logits_processors", "custom logits processors are not supported"},
      {"vllm_xargs", "custom logits processor arguments are not supported"},
      {"kv_transfer_params", "KV transfer (disaggregated prefill) is not supported"},
      {"prompt_embeds", "prompt embeddings are not supported"},
      {"return_tokens_as_token_ids", "return_tokens_as_token_ids is not implemented"},
      {"mm_processor_kwargs", "multimodal inputs are not supported"},
      {"chat_template", "a request-supplied chat template is not accepted; the model's own is used"},
      {"chat_template_kwargs", "chat template arguments are not supported"},
      {"documents", "documents (RAG chat templates) are not supported"},
      {"reasoning_effort", "reasoning_effort is not supported"},
      {"functions", "'functions' is not supported"},
  };
  for (const Refused& r : kRefused)
    if (const Json* v = present(b, r.key); v && set(*v))
      return bad_request(fmt::format("'{}' is not supported: {}", r.key, r.why), r.key);
  {
    std::optional<int64_t> priority;
    MOELORA_TRY_API(read_opt_int(b, "priority", &priority));
    if (priority && *priority != 0)
      return bad_request("'priority' is not supported: requests are served in arrival order (only 0)", "priority");
  }
  {
    std::optional<double> lp;
    MOELORA_TRY_API(read_opt_number(b, "length_penalty", &lp));
    if (lp && *lp != 1.0) return bad_request("'length_penalty' only applies to beam search (only 1)", "length_penalty");
  }
  {
    std::optional<bool> spaces;
    MOELORA_TRY_API(read_opt_bool(b, "spaces_between_special_tokens", &spaces));
    if (spaces && !*spaces)
      return bad_request("'spaces_between_special_tokens' = false is not implemented", "spaces_between_special_tokens");
  }
  if (chat) {
    std::optional<bool> echo;
    MOELORA_TRY_API(read_opt_bool(b, "echo", &echo));
    if (echo.value_or(false)) return bad_request("'echo' is not supported for chat completions", "echo");
  }
  if (const Json* v = present(b, "suffix")) {
    if (!v->is_string()) return type_error("suffix", "a string", *v);
    if (!v->get<std::string>().empty()) return bad_request("'suffix' is not supported", "suffix");
  }
  // Chat requests carry tools to the template (parse_tools); completions have no use for them.
  if (const Json* v = present(b, "tools"); v && !chat)
    if (!(v->is_array() && v->empty())) return bad_request("'tools' is only supported by chat completions", "tools");
  if (const Json* v = present(b, "response_format")) {
    if (!v->is_object()) return type_error("response_format", "an object", *v);
    auto t = v->find("type");
    if (t == v->end() || !t->is_string() || t->get<std::string>() != "text")
      return bad_request("only response_format {\"type\": \"text\"} is supported", "response_format");
  }
  return std::nullopt;
}

bool token_in_vocab(int64_t id, const ProtocolLimits& limits) {
  return id >= 0 && id <= std::numeric_limits<int32_t>::max() && (limits.vocab_size <= 0 || id < limits.vocab_size);
}

// vLLM's logit processors: penalties, min_tokens, logit_bias, allowed_token_ids, bad_words, with
// vLLM's ranges. min_tokens is checked against max_tokens once that is known (parse_options, and
// GenerationJob for a chat whose max_tokens fills the context).
std::optional<ApiError> parse_logit_processors(const Json& b, const ProtocolLimits& limits, GenerationOptions* o) {
  SamplingParams& s = o->sampling;
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    std::optional<double> v;
    MOELORA_TRY_API(read_opt_number(b, key, &v));
    if (!v) continue;
    if (!(*v >= -2.0 && *v <= 2.0)) return bad_request(fmt::format("'{}' must be in [-2, 2], got {}", key, *v), key);
    (key[0] == 'p' ? s.presence_penalty : s.frequency_penalty) = static_cast<float>(*v);
  }
  {
    std::optional<double> v;
    MOELORA_TRY_API(read_opt_number(b, "repetition_penalty", &v));
    if (v) {
      if (!(*v > 0.0 && *v <= 2.0))
        return bad_request(fmt::format("'repetition_penalty' must be in (0, 2], got {}", *v), "repetition_penalty");
      s.repetition_penalty = static_cast<float>(*v);
    }
  }
  {
    std::optional<int64_t> v;
    MOELORA_TRY_API(read_opt_int(b, "min_tokens", &v));
    if (v) {
      if (*v < 0) return bad_request(fmt::format("'min_tokens' must be >= 0, got {}", *v), "min_tokens");
      if (o->max_tokens_given && *v > s.max_tokens)
        return bad_request(fmt::format("'min_tokens' must be <= max_tokens = {}, got {}", s.max_tokens, *v),
                           "min_tokens");
      s.min_tokens = static_cast<int>(std::min<int64_t>(*v, std::numeric_limits<int>::max() / 2));
    }
  }
  if (const Json* lb = present(b, "logit_bias")) {
    if (!lb->is_object()) return type_error("logit_bias", "an object of token ids to numbers", *lb);
    if (static_cast<int>(lb->size()) > limits.max_logit_bias)
      return bad_request(fmt::format("'logit_bias' has {} entries; at most {} are allowed", lb->size(),
                                     limits.max_logit_bias),
                         "logit_bias");
    for (auto it = lb->begin(); it != lb->end(); ++it) {
      // Keys are token ids written as decimal strings (JSON keys are strings).
      const std::string& k = it.key();
      int64_t id = -1;
      const bool digits = !k.empty() && k.size() <= 10 && std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (digits) id = std::stoll(k);
      if (!digits || !token_in_vocab(id, limits))
        return bad_request(fmt::format("'logit_bias' key {} is not a token id in the vocabulary{}", shown(Json(k)),
                                       limits.vocab_size > 0 ? fmt::format(" (0..{})", limits.vocab_size - 1) : ""),
                           "logit_bias");
      if (!it.value().is_number())
        return type_error("logit_bias", "an object whose values are numbers", it.value());
      const double bias = it.value().get<double>();
      if (!(bias >= -100.0 && bias <= 100.0))
        return bad_request(fmt::format("'logit_bias' value {} of token {} is outside [-100, 100]", bias, id),
                           "logit_bias");
      s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
    }
  }
  if (const Json* ids = present(b, "allowed_token_ids")) {
    MOELORA_TRY_API(read_token_ids(*ids, "allowed_token_ids", &s.allowed_token_ids));
    if (s.allowed_token_ids.empty())
      return bad_request("'allowed_token_ids' must not be empty (it would ban every token)", "allowed_token_ids");
    for (int32_t t : s.allowed_token_ids)
      if (!token_in_vocab(t, limits))
        return bad_request(fmt::format("'allowed_token_ids' holds {}, which is not in the vocabulary", t),
                           "allowed_token_ids");
  }
  if (const Json* bw = present(b, "bad_words")) {
    if (!bw->is_array()) return type_error("bad_words", "an array of strings", *bw);
    if (static_cast<int>(bw->size()) > limits.max_bad_words)
      return bad_request(fmt::format("at most {} bad_words are allowed", limits.max_bad_words), "bad_words");
    for (const Json& w : *bw) {
      if (!w.is_string()) return type_error("bad_words", "an array of strings", *bw);
      o->bad_words.push_back(w.get<std::string>());
    }
  }
  return std::nullopt;
}

// vLLM's request fields that moelora implements beyond sampling.
std::optional<ApiError> parse_vllm_extras(const Json& b, const ProtocolLimits& limits, GenerationOptions* o) {
  MOELORA_TRY_API(read_opt_bool(b, "add_special_tokens", &o->add_special_tokens));
  std::optional<int64_t> trunc;
  MOELORA_TRY_API(read_opt_int(b, "truncate_prompt_tokens", &trunc));
  if (trunc) {
    if (*trunc < -1 || *trunc == 0)
      return bad_request(fmt::format("'truncate_prompt_tokens' must be -1 (the context length) or >= 1, got {}", *trunc),
                         "truncate_prompt_tokens");
    o->truncate_prompt_tokens = static_cast<int>(std::min<int64_t>(*trunc, std::numeric_limits<int>::max()));
  }
  std::optional<std::string> salt;
  MOELORA_TRY_API(read_opt_string(b, "cache_salt", &salt));
  if (salt) {
    if (salt->empty()) return bad_request("'cache_salt' must not be empty", "cache_salt");
    if (salt->size() > 1024) return bad_request("'cache_salt' is longer than 1024 bytes", "cache_salt");
    o->cache_salt = *salt;
  }
  MOELORA_TRY_API(read_opt_string(b, "request_id", &o->request_id));
  if (o->request_id && o->request_id->size() > 256)
    return bad_request("'request_id' is longer than 256 bytes", "request_id");
  (void)limits;
  return std::nullopt;
}

std::optional<ApiError> parse_options(const Json& b, const ProtocolLimits& limits, bool chat, GenerationOptions* o) {
  MOELORA_TRY_API(refuse_unsupported(b, chat));
  std::optional<std::string> model;
  MOELORA_TRY_API(read_opt_string(b, "model", &model));
  o->model = model.value_or("");
  MOELORA_TRY_API(read_opt_string(b, "lora_path", &o->lora_path));

  SamplingParams& s = o->sampling;
  std::optional<int64_t> max_tokens;
  MOELORA_TRY_API(read_opt_int(b, "max_tokens", &max_tokens));
  const char* max_key = "max_tokens";
  if (chat && !max_tokens) {
    MOELORA_TRY_API(read_opt_int(b, "max_completion_tokens", &max_tokens));
    max_key = "max_completion_tokens";
  }
  if (max_tokens) {
    if (*max_tokens < 1)
      return bad_request(fmt::format("'{}' must be at least 1, got {}", max_key, *max_tokens), max_key);
    s.max_tokens = static_cast<int>(std::min<int64_t>(*max_tokens, std::numeric_limits<int>::max() / 2));
    o->max_tokens_given = true;
  } else if (!chat) {
    s.max_tokens = 16;  // OpenAI's and vLLM's default for completions
    o->max_tokens_given = true;
  }

  std::optional<double> temperature, top_p, min_p;
  MOELORA_TRY_API(read_opt_number(b, "temperature", &temperature));
  if (temperature) {
    if (!(*temperature >= 0.0) || !std::isfinite(*temperature))
      return bad_request(fmt::format("'temperature' must be >= 0, got {}", *temperature), "temperature");
    s.temperature = static_cast<float>(*temperature);
  } else {
    s.temperature = 1.0f;
  }
  MOELORA_TRY_API(read_opt_number(b, "top_p", &top_p));
  if (top_p) {
    if (!(*top_p > 0.0 && *top_p <= 1.0))
      return bad_request(fmt::format("'top_p' must be in (0, 1], got {}", *top_p), "top_p");
    s.top_p = static_cast<float>(*top_p);
  }
  std::optional<int64_t> top_k;
  MOELORA_TRY_API(read_opt_int(b, "top_k", &top_k));
  if (top_k) {
    if (*top_k < -1) return bad_request(fmt::format("'top_k' must be -1, 0 (off) or positive, got {}", *top_k), "top_k");
    s.top_k = *top_k <= 0 ? 0 : static_cast<int>(std::min<int64_t>(*top_k, 1 << 30));
  }
  MOELORA_TRY_API(read_opt_number(b, "min_p", &min_p));
  if (min_p) {
    if (!(*min_p >= 0.0 && *min_p <= 1.0))
      return bad_request(fmt::format("'min_p' must be in [0, 1], got {}", *min_p), "min_p");
    s.min_p = static_cast<float>(*min_p);
  }
  std::optional<int64_t> seed;
  MOELORA_TRY_API(read_opt_int(b, "seed", &seed));
  if (seed) s.seed = static_cast<uint64_t>(*seed);

  std::optional<int64_t> n;
  MOELORA_TRY_API(read_opt_int(b, "n", &n));
  if (n) {
    if (*n < 1 || *n > limits.max_n)
      return bad_request(fmt::format("'n' must be in [1, {}], got {}", limits.max_n, *n), "n");
    o->n = static_cast<int>(*n);
  }
  std::optional<int64_t> best_of;
  MOELORA_TRY_API(read_opt_int(b, "best_of", &best_of));
  if (best_of && *best_of != o->n) return bad_request("'best_of' is not supported (it must equal n)", "best_of");

  std::optional<bool> flag;
  MOELORA_TRY_API(read_opt_bool(b, "stream", &flag));
  o->stream = flag.value_or(false);
  if (const Json* so = present(b, "stream_options")) {
    if (!so->is_object()) return type_error("stream_options", "an object", *so);
    if (!o->stream)
      return bad_request("Stream options can only be defined when `stream=True`.", "stream_options");
    std::optional<bool> inc, cont;
    MOELORA_TRY_API(read_opt_bool(*so, "include_usage", &inc));
    MOELORA_TRY_API(read_opt_bool(*so, "continuous_usage_stats", &cont));
    // vLLM: include_usage defaults to true once stream_options is present.
    o->include_usage = inc.value_or(true);
    o->continuous_usage_stats = cont.value_or(false);
  }

  if (const Json* st = present(b, "stop")) {
    if (st->is_string()) {
      o->stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      for (const Json& e : *st) {
        if (!e.is_string()) return type_error("stop", "a string or an array of strings", *st);
        o->stop.push_back(e.get<std::string>());
      }
    } else {
      return type_error("stop", "a string or an array of strings", *st);
    }
    if (static_cast<int>(o->stop.size()) > limits.max_stop_strings)
      return bad_request(fmt::format("at most {} stop strings are allowed", limits.max_stop_strings), "stop");
  }
  if (const Json* ids = present(b, "stop_token_ids")) MOELORA_TRY_API(read_token_ids(*ids, "stop_token_ids", &s.stop_token_ids));
  MOELORA_TRY_API(read_opt_bool(b, "ignore_eos", &flag));
  if (flag) s.ignore_eos = *flag;
  flag.reset();
  MOELORA_TRY_API(read_opt_bool(b, "include_stop_str_in_output", &flag));
  o->include_stop_str_in_output = flag.value_or(false);
  flag.reset();
  MOELORA_TRY_API(read_opt_bool(b, "skip_special_tokens", &flag));
  o->skip_special_tokens = flag.value_or(true);
  flag.reset();
  MOELORA_TRY_API(read_opt_bool(b, "return_token_ids", &flag));
  o->return_token_ids = flag.value_or(false);

  // logprobs: an integer (completions) or a boolean plus top_logprobs (chat).
  if (chat) {
    flag.reset();
    MOELORA_TRY_API(read_opt_bool(b, "logprobs", &flag));
    o->want_logprobs = flag.value_or(false);
    std::optional<int64_t> top;
    MOELORA_TRY_API(read_opt_int(b, "top_logprobs", &top));
    if (top) {
      if (*top < 0 || *top > 20) return bad_request("'top_logprobs' must be in [0, 20]", "top_logprobs");
      if (!o->want_logprobs && *top > 0)
        return bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs");
      o->top_logprobs = static_cast<int>(*top);
    }
  } else {
    std::optional<int64_t> lp;
    MOELORA_TRY_API(read_opt_int(b, "logprobs", &lp));
    if (lp) {
      if (*lp < 0 || *lp > 20) return bad_request("'logprobs' must be in [0, 20]", "logprobs");
      o->want_logprobs = true;
      o->top_logprobs = static_cast<int>(*lp);
    }
  }
  s.logprobs = o->top_logprobs;
  MOELORA_TRY_API(parse_logit_processors(b, limits, o));
  MOELORA_TRY_API(parse_vllm_extras(b, limits, o));
  return std::nullopt;
}

std::optional<ApiError> parse_prompts(const Json& p, const ProtocolLimits& limits, std::vector<PromptInput>* out) {
  auto ids_prompt = [&](const Json& arr) -> std::optional<ApiError> {
    PromptInput in;
    in.is_ids = true;
    MOELORA_TRY_API(read_token_ids(arr, "prompt", &in.ids));
    // Checked here as for logit_bias and allowed_token_ids, so the 400 names the parameter (the
    // engine refuses such ids too, as its last line of defence).
    for (int32_t t : in.ids)
      if (!token_in_vocab(t, limits))
        return bad_request(fmt::format("'prompt' holds token id {}, which is not in the vocabulary (0..{})", t,
                                       limits.vocab_size - 1),
                           "prompt");
    out->push_back(std::move(in));
    return std::nullopt;
  };
  if (p.is_string()) {
    out->push_back({false, p.get<std::string>(), {}});
  } else if (p.is_array() && !p.empty() && p[0].is_number()) {
    MOELORA_TRY_API(ids_prompt(p));
  } else if (p.is_array() && !p.empty()) {
    if (static_cast<int>(p.size()) > limits.max_prompts)
      return bad_request(fmt::format("at most {} prompts per request", limits.max_prompts), "prompt");
    for (const Json& e : p) {
      if (e.is_string()) out->push_back({false, e.get<std::string>(), {}});
      else if (e.is_array()) MOELORA_TRY_API(ids_prompt(e));
      else return type_error("prompt", "a string, an array of strings or an array of token ids", p);
    }
  } else {
    return type_error("prompt", "a non-empty string, array of strings or array of token ids", p);
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_completion_request(const Json& body, const ProtocolLimits& limits,
                                                 CompletionRequest* out) {
  MOELORA_TRY_API(parse_options(body, limits, /*chat=*/false, &out->opts));
  const Json* p = present(body, "prompt");
  if (!p) return bad_request("'prompt' is required", "prompt");
  MOELORA_TRY_API(parse_prompts(*p, limits, &out->prompts));
  const int64_t choices = static_cast<int64_t>(out->prompts.size()) * out->opts.n;
  if (choices > limits.max_choices)
    return bad_request(fmt::format("{} prompts x n = {} asks for {} sequences; at most {} are allowed per request",
                                   out->prompts.size(), out->opts.n, choices, limits.max_choices),
                       "n");
  std::optional<bool> echo;
  MOELORA_TRY_API(read_opt_bool(body, "echo", &echo));
  out->echo = echo.value_or(false);
  if (out->echo && out->opts.want_logprobs)
    return bad_request("'echo' together with 'logprobs' (prompt logprobs) is not supported", "echo");
  return std::nullopt;
}

std::optional<ApiError> tokenize_bad_words(const std::vector<std::string>& words, const EncodeFn& encode,
                                           int vocab_size, std::vector<std::vector<int32_t>>* out) {
  for (const std::string& word : words) {
    const size_t first = word.find_first_not_of(" \t\n\r\f\v");
    const std::string stripped = first == std::string::npos ? std::string() : word.substr(first);
    std::vector<int32_t> plain;
    for (int spaced = 0; spaced < 2; ++spaced) {
      auto ids = encode(spaced ? " " + stripped : stripped);
      if (!ids.ok()) return bad_request(fmt::format("'bad_words': {}", ids.status().message()), "bad_words");
      if (ids->empty()) {
        if (!spaced) return bad_request(fmt::format("'bad_words' entry {} encodes to no tokens", shown(Json(word))),
                                        "bad_words");
        continue;
      }
      for (int32_t t : *ids)
        if (t < 0 || (vocab_size > 0 && t >= vocab_size))
          return bad_request(fmt::format("'bad_words' entry {} encodes to token {}, outside the model's vocabulary",
                                         shown(Json(word)), t),
                             "bad_words");
      if (!spaced) {
        plain = *ids;
        out->push_back(std::move(ids).value());
      } else if ((*ids)[0] != plain[0] && ids->size() == plain.size()) {
        out->push_back(std::move(ids).value());
      }
    }
  }
  return std::nullopt;
}

std::optional<ApiError> parse_chat_messages(const Json& messages, std::vector<ChatMessage>* out) {
  if (!messages.is_array() || messages.empty())
    return bad_request("'messages' must be a non-empty array of messages", "messages");
  for (const Json& m : messages) {
    if (!m.is_object()) return type_error("messages", "an array of objects", m);
    ChatMessage msg;
    auto role = m.find("role");
    if (role == m.end() || !role->is_string())
      return bad_request("every message needs a string 'role'", "messages");
    msg.role = role->get<std::string>();
    static const char* kRoles[] = {"system", "user", "assistant", "tool", "developer", "function"};
    if (std::find(std::begin(kRoles), std::end(kRoles), msg.role) == std::end(kRoles))
      return bad_request(fmt::format("unknown message role '{}'", msg.role), "messages");
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      // Allowed for assistant messages (tool calls); nothing to render.
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const Json& part : *content) {
        if (!part.is_object()) return type_error("messages", "content parts as objects", part);
        auto type = part.find("type");
        auto text = part.find("text");
        if (type == part.end() || !type->is_string() || type->get<std::string>() != "text")
          return bad_request("only text content parts are supported", "messages");
        if (text == part.end() || !text->is_string())
          return bad_request("a text content part needs a string 'text'", "messages");
        msg.content += text->get<std::string>();
      }
    } else {
      return type_error("messages", "content as a string or an array of parts", *content);
    }
    if (auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
      if (!calls->is_array()) return type_error("messages", "'tool_calls' as an array", *calls);
      for (const Json& call : *calls) {
        const auto fn = call.find("function");
        if (!call.is_object() || fn == call.end() || !fn->is_object() || !fn->contains("name") ||
            !(*fn)["name"].is_string())
          return bad_request("every tool call needs a 'function' with a string 'name'", "messages");
      }
      msg.tool_fields["tool_calls"] = OJson(*calls);
    }
    for (const char* key : {"tool_call_id", "name"}) {
      if (auto v = m.find(key); v != m.end() && !v->is_null()) {
        if (!v->is_string()) return type_error("messages", fmt::format("'{}' as a string", key).c_str(), *v);
        msg.tool_fields[key] = v->get<std::string>();
      }
    }
    out->push_back(std::move(msg));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_tools(const Json& body, OJson* out) {
  *out = nullptr;
  const Json* tools = present(body, "tools");
  if (!tools) return std::nullopt;
  if (!tools->is_array()) return type_error("tools", "an array of tools", *tools);
  for (const Json& t : *tools) {
    // A "type" other than the string "function" (a number too) is refused, not a 500.
    const auto type = t.find("type");
    const auto fn = t.find("function");
    if (!t.is_object() || (type != t.end() && !(type->is_string() && *type == "function")) || fn == t.end() ||
        !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string() ||
        (*fn)["name"].get<std::string>().empty())
      return bad_request("every tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools");
  }
  if (!tools->empty()) *out = OJson(*tools);
  return std::nullopt;
}

void keep_client_key_order(std::string_view body, std::vector<ChatMessage>* messages, OJson* tools) {
  const bool has_calls = std::any_of(messages->begin(), messages->end(),
                                     [](const ChatMessage& m) { return m.tool_fields.contains("tool_calls"); });
  if (!has_calls && (tools == nullptr || tools->is_null())) return;
  const auto ordered = OJson::parse(body, nullptr, false);
  if (!ordered.is_object()) return;
  if (tools != nullptr && !tools->is_null() && ordered.contains("tools")) *tools = ordered["tools"];
  const auto m = ordered.find("messages");
  if (m == ordered.end() || !m->is_array() || m->size() != messages->size()) return;
  for (size_t i = 0; i < messages->size(); ++i) {
    OJson& fields = (*messages)[i].tool_fields;
    const OJson& sent = (*m)[i];
    if (!fields.contains("tool_calls") || !sent.is_object()) continue;
    if (const auto calls = sent.find("tool_calls"); calls != sent.end()) fields["tool_calls"] = *calls;
  }
}

std::optional<ApiError> parse_chat_completion_request(const Json& body, const ProtocolLimits& limits,
                                                      ChatCompletionRequest* out) {
  MOELORA_TRY_API(parse_options(body, limits, /*chat=*/true, &out->opts));
  const Json* m = present(body, "messages");
  if (!m) return bad_request("'messages' is required", "messages");
  MOELORA_TRY_API(parse_chat_messages(*m, &out->messages));
  std::optional<bool> flag;
  MOELORA_TRY_API(read_opt_bool(body, "add_generation_prompt", &flag));
  out->add_generation_prompt = flag.value_or(true);
  flag.reset();
  MOELORA_TRY_API(read_opt_bool(body, "continue_final_message", &flag));
  out->continue_final_message = flag.value_or(false);
  if (out->continue_final_message && out->add_generation_prompt && present(body, "add_generation_prompt"))
    return bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                       "continue_final_message");
  if (out->continue_final_message) out->add_generation_prompt = false;
  MOELORA_TRY_API(parse_tools(body, &out->tools));
  if (const Json* choice = present(body, "tool_choice")) {
    if (choice->is_string() && (*choice == "auto" || *choice == "none")) {
      out->tool_choice = choice->get<std::string>();
    } else if (choice->is_string() && *choice != "required") {
      return bad_request(fmt::format("'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, "
                                     "got {}", shown(*choice)),
                         "tool_choice");
    } else {
      return bad_request("'tool_choice' \"required\" or a named function needs guided decoding, which moelora does "
                         "not implement; use \"auto\"",
                         "tool_choice");
    }
    if (out->tools.is_null() && out->tool_choice != "none")
      return bad_request("'tool_choice' needs 'tools'", "tool_choice");
  }
  return std::nullopt;
}

}  // namespace moelora::server
