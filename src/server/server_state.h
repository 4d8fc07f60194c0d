// What every endpoint of the HTTP server shares (internal to src/server).
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "runtime/engine.h"
#include "server/api_error.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/serving_tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace moelora::server {

struct ServerState {
  Engine& engine;
  std::shared_ptr<const ServingTokenizer> tokenizer;
  ServerOptions options;
  ServerMetrics metrics;
  std::atomic<bool> draining{false};

  ServerState(Engine& e, std::shared_ptr<const ServingTokenizer> t, ServerOptions o);

  // The adapter a request's `model` (and sglang's `lora_path`) selects: "" for the base model.
  // Accepts the served name, an adapter name, and sglang's "base:adapter". Unknown: 404.
  std::optional<ApiError> resolve_model(const std::string& model, const std::optional<std::string>& lora_path,
                                        std::string* adapter) const;

  void send_error(httplib::Response& res, const ApiError& error);
  void send_json(httplib::Response& res, int status, const Json& body);
  void send_json(httplib::Response& res, int status, const OJson& body);
};

// Route groups, one per file.
void register_generation_routes(httplib::Server& http, ServerState& state);   // generation_endpoints.cpp
void register_model_routes(httplib::Server& http, ServerState& state);        // model_endpoints.cpp
void register_tokenize_routes(httplib::Server& http, ServerState& state);     // tokenize_endpoints.cpp

}  // namespace moelora::server
