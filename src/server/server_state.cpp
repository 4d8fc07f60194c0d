// ServerState (model resolution, error and JSON answers) and the Router's admission checks.
#include "server/server_state.h"

#include "model/model.h"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

namespace moelora::server {

ServerState::ServerState(ServerOptions o) : options(std::move(o)), metrics(options.served_model_name, options.max_loras) {}

void ServerState::attach(Engine& e, std::shared_ptr<const ServingTokenizer> t) {
  tokenizer = std::move(t);
  options.limits.vocab_size = e.model().config().vocab_size;  // handlers read it only once ready()
  engine_.store(&e, std::memory_order_release);
}

std::optional<ApiError> ServerState::resolve_model(const std::string& model, const std::optional<std::string>& lora_path,
                                                   std::string* adapter) const {
  const std::string& base = options.served_model_name;
  std::string from_model;  // adapter named by `model`, if any
  bool model_is_base = model.empty() || model == base;
  if (!model_is_base) {
    if (engine().has_adapter(model)) {
      from_model = model;
    } else {
      // sglang: "base-model:adapter-name" (adapter names cannot contain ':').
      const size_t colon = model.rfind(':');
      if (colon == std::string::npos || model.substr(0, colon) != base) return model_not_found(model);
      from_model = model.substr(colon + 1);
      if (from_model.empty()) {
        model_is_base = true;
      } else if (!engine().has_adapter(from_model)) {
        return model_not_found(model);
      }
    }
  }
  if (lora_path && !lora_path->empty()) {
    // sglang's explicit field names the adapter; `model` must then be the base or agree.
    if (!from_model.empty() && from_model != *lora_path)
      return bad_request(fmt::format("'lora_path' ({}) and 'model' ({}) name different adapters", *lora_path, model),
                         "lora_path");
    if (!engine().has_adapter(*lora_path))
      return ApiError{404, "NotFoundError", fmt::format("The model `{}` does not exist.", *lora_path), "lora_path"};
    *adapter = *lora_path;
    return std::nullopt;
  }
  *adapter = from_model;
  return std::nullopt;
}

void ServerState::send_error(HttpResponse& res, const ApiError& error) const {
  res.status = error.http_status;
  res.set_content(error.body(), "application/json");
  if (error.http_status == 503 || error.http_status == 429) res.set_header("Retry-After", "1");
  if (error.http_status == 401) res.set_header("WWW-Authenticate", "Bearer");
}

void ServerState::send_json(HttpResponse& res, int status, const Json& body) const {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void ServerState::send_json(HttpResponse& res, int status, const OJson& body) const {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void Router::add(std::string method, std::string path, RouteKind kind, Handler handler) {
  routes_.push_back({std::move(method), std::move(path), kind, std::move(handler)});
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

bool bearer_token_matches(std::string_view authorization, const std::vector<std::string>& keys) {
  authorization = trim(authorization);
  if (authorization.size() < 7 || lower(authorization.substr(0, 7)) != "bearer ") return false;
  const std::string_view token = trim(authorization.substr(7));
  // Every key is compared over its whole length whatever matches, so the time taken tells an
  // attacker neither which key nor how many leading bytes were right.
  bool any = false;
  for (const std::string& key : keys) {
    unsigned diff = token.size() == key.size() ? 0u : 1u;
    for (size_t i = 0; i < key.size(); ++i) {
      const unsigned char t = i < token.size() ? static_cast<unsigned char>(token[i]) : 0u;
      diff |= t ^ static_cast<unsigned char>(key[i]);
    }
    any |= diff == 0 && !key.empty();
  }
  return any;
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host == "[::1]") return true;
  // 127.0.0.0/8 written as a dotted quad (a name like "127.0.0.1.example.com" is not one).
  int parts = 0, digits = 0;
  for (char c : host) {
    if (c == '.') {
      if (digits == 0) return false;
      ++parts;
      digits = 0;
    } else if (c >= '0' && c <= '9' && digits < 3) {
      ++digits;
    } else {
      return false;
    }
  }
  return parts == 3 && digits > 0 && host.rfind("127.", 0) == 0;
}

bool host_allowed(std::string_view host_header, const ServerOptions& o) {
  std::string host = lower(trim(host_header));
  // Strip the port: "[::1]:8000" -> "[::1]", "name:8000" -> "name".
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    host = host.substr(0, close + 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  if (!o.allowed_hosts.empty())
    return std::any_of(o.allowed_hosts.begin(), o.allowed_hosts.end(),
                       [&](const std::string& h) { return h == "*" || lower(h) == host; });
  // A loopback listener is meant for this machine: a web page that rebinds its own DNS name to
  // 127.0.0.1 sends its own name as Host and is refused.
  if (is_loopback_host(o.host)) return host.empty() || is_loopback_host(host) || host == "localhost";
  return true;
}

std::optional<ApiError> Router::admit(const ServerState& st, const HttpRequest& head, const Route** route) const {
  const ServerOptions& o = st.options;
  if (!host_allowed(head.header("host"), o))
    return ApiError{400, "BadRequestError", "Invalid host header", ""};
  const Route* found = nullptr;
  bool path_known = false;
  for (const Route& r : routes_) {
    if (r.path != head.path) continue;
    path_known = true;
    if (r.method == head.method) found = &r;
  }
  if (!path_known) return ApiError{404, "NotFoundError", fmt::format("Not Found: {} {}", head.method, head.path), ""};
  if (!found) return ApiError{405, "MethodNotAllowedError", fmt::format("Method Not Allowed: {} {}", head.method, head.path), ""};
  if (found->kind != RouteKind::kPublic) {
    if (!o.api_keys.empty() && !bearer_token_matches(head.header("authorization"), o.api_keys))
      return ApiError{401, "AuthenticationError", "Unauthorized: a valid 'Authorization: Bearer <api key>' is required",
                      ""};
    if (found->method == "POST") {
      // Only JSON: a form or text/plain POST is what a web page may send cross-origin without
      // a CORS preflight, so accepting it would let any page drive a local server.
      const std::string type = lower(trim(head.header("content-type")));
      const std::string media = std::string(trim(std::string_view(type).substr(0, type.find(';'))));
      if (media != "application/json")
        return ApiError{415, "UnsupportedMediaTypeError",
                        fmt::format("POST bodies must be 'Content-Type: application/json'{}",
                                    type.empty() ? "" : fmt::format(", got '{}'", type)),
                        ""};
    }
    if (head.has_header("content-encoding")) {
      // Bodies are never decompressed: a small gzip body could inflate far past the limit.
      const std::string enc = lower(trim(head.header("content-encoding")));
      if (enc != "identity")
        return ApiError{415, "UnsupportedMediaTypeError",
                        fmt::format("compressed request bodies (Content-Encoding: {}) are not accepted", enc), ""};
    }
    if (!st.ready()) return ApiError{503, "ServiceUnavailableError", "the model is still loading", ""};
  }
  *route = found;
  return std::nullopt;
}

}  // namespace moelora::server
