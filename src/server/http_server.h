// The OpenAI-compatible HTTP server (docs/serving.md) over an Engine:
//   POST /v1/completions, /v1/chat/completions   (SSE when "stream": true)
//   GET  /v1/models
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (only with --lora-root)
//   POST /tokenize, /detokenize                            (vLLM's)
//   GET  /health, /metrics, /version
// HTTP/1.1 on Boost.Beast/Asio: a few I/O threads serve every connection asynchronously, so
// thousands of open streams cost sockets and buffers, not threads. Handlers that parse, tokenize
// or wait run on a worker pool (adapter loads on their own pool), never on the I/O threads.
// Every limit is explicit (ServerOptions): header bytes and count, body bytes (counted as chunks
// arrive, never decompressed), idle and whole-request deadlines, connections, open generations.
// The port is bound before the model loads: /health answers 503 until attach().
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "runtime/engine.h"
#include "server/openai_protocol.h"

namespace moelora::server {

class ServingTokenizer;
struct ServerState;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0 = any free port (bind() returns it)
  std::string served_model_name;         // the base model's name in the API
  std::string model_path;                // shown as the base model's `root`
  int max_loras = 8;                     // vllm:lora_requests_info's max_lora label
  bool allow_runtime_lora = false;       // /v1/load_lora_adapter and /v1/unload_lora_adapter
  std::string lora_root;                 // where runtime loads may read (required for them)
  // Authentication (vLLM's --api-key): empty = none. Every /v1 route and /tokenize,
  // /detokenize need "Authorization: Bearer <one of them>".
  std::vector<std::string> api_keys;
  // Host header values (without port) that are answered; empty = loopback names only when
  // listening on loopback (DNS-rebinding defence), anything otherwise.
  std::vector<std::string> allowed_hosts;

  size_t max_request_bytes = 32u << 20;  // body bytes (413 beyond; chunked bodies counted as they arrive)
  size_t max_header_bytes = 32u << 10;   // request line + headers (431 beyond)
  int max_header_count = 100;            // header fields (431 beyond)
  int http_threads = 4;                  // I/O threads
  int worker_threads = 4;                // handlers (parse, tokenize, submit)
  int max_connections = 8192;            // open connections; more are answered 503 and closed
  int max_open_requests = 4096;          // generation responses open at once (streams included): 503 beyond
  int listen_backlog = 1024;
  std::chrono::milliseconds keep_alive_timeout{5000};   // idle connection between requests
  std::chrono::milliseconds read_idle_timeout{10000};   // no byte while a request is arriving: 408
  std::chrono::milliseconds request_timeout{30000};     // a whole request (headers + body) must arrive in this: 408
  std::chrono::milliseconds write_timeout{30000};       // a client that stops reading is dropped after this
  std::chrono::milliseconds heartbeat{500};             // idle SSE streams get a comment this often
  std::chrono::milliseconds stats_interval{10000};      // the periodic throughput log line (0: off)
  ProtocolLimits limits;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens, and starts serving (/health: 503 until attach()). Returns the port.
  Result<int> start();
  // The model is loaded: generation, models and tokenize routes open.
  void attach(Engine& engine, std::shared_ptr<const ServingTokenizer> tokenizer);
  // Blocks until the server has stopped (shutdown() or stop()).
  void wait();
  // Graceful: new generation requests get 503, running ones get up to `grace` to finish, the
  // rest are cancelled (their streams end with an error event), then the server stops.
  void shutdown(std::chrono::milliseconds grace);
  // Immediate stop: connections closed, threads joined. Safe to call twice.
  void stop();

  const ServerOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Listening beyond loopback without --api-key is worth a warning (anyone on the network can
// generate, and with --lora-root load adapters).
bool is_loopback_host(const std::string& host);

}  // namespace moelora::server
