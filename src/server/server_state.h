// What every endpoint of the HTTP server shares (internal to src/server), and the route table.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/http_server.h"
#include "server/http_types.h"
#include "server/metrics.h"
#include "server/serving_tokenizer.h"

namespace moelora::server {

struct ServerState {
  ServerOptions options;
  ServerMetrics metrics;
  std::atomic<bool> draining{false};
  std::shared_ptr<const ServingTokenizer> tokenizer;  // set by attach(), before `ready`

  explicit ServerState(ServerOptions o);

  // The model is loaded (HttpServer::attach): routes that need it are open.
  bool ready() const { return engine_.load(std::memory_order_acquire) != nullptr; }
  void attach(Engine& e, std::shared_ptr<const ServingTokenizer> t);
  Engine& engine() const { return *engine_.load(std::memory_order_acquire); }

  // The adapter a request's `model` (and sglang's `lora_path`) selects: "" for the base model.
  // Accepts the served name, an adapter name, and sglang's "base:adapter". Unknown: 404.
  std::optional<ApiError> resolve_model(const std::string& model, const std::optional<std::string>& lora_path,
                                        std::string* adapter) const;

  void send_error(HttpResponse& res, const ApiError& error) const;
  void send_json(HttpResponse& res, int status, const Json& body) const;
  void send_json(HttpResponse& res, int status, const OJson& body) const;

 private:
  std::atomic<Engine*> engine_{nullptr};
};

using Handler = std::function<void(ServerState&, const HttpRequest&, HttpResponse&)>;

// Where a route's handler runs and what it requires.
enum class RouteKind {
  kPublic,      // /health, /metrics, /version: no key, runs on the I/O thread (cheap, never blocks)
  kApi,         // needs the API key and the model; runs on the worker pool
  kAdapterAdmin,  // like kApi, on the adapter pool (reads files, waits for drains)
};

struct Route {
  std::string method;
  std::string path;
  RouteKind kind = RouteKind::kApi;
  Handler handler;
};

class Router {
 public:
  void add(std::string method, std::string path, RouteKind kind, Handler handler);
  // Decides from the request line and headers alone (before any body byte is read) whether the
  // request is served: host (400), route (404/405), key (401), media type and encoding of a
  // POST body (415), readiness (503). On success `*route` is the route to run.
  std::optional<ApiError> admit(const ServerState& st, const HttpRequest& head, const Route** route) const;

 private:
  std::vector<Route> routes_;
};

// Constant-time check of "Authorization: Bearer <key>" against every configured key.
bool bearer_token_matches(std::string_view authorization, const std::vector<std::string>& keys);
// Is `host_header` (a Host value, maybe with a port) one the server answers?
bool host_allowed(std::string_view host_header, const ServerOptions& options);

// Route groups, one per file.
void register_generation_routes(Router& router);   // generation_endpoints.cpp
void register_model_routes(Router& router);        // model_endpoints.cpp
void register_tokenize_routes(Router& router);     // tokenize_endpoints.cpp

}  // namespace moelora::server
