// The OpenAI-compatible HTTP server (SPEC §5) over an Engine, on cpp-httplib:
//   POST /v1/completions, /v1/chat/completions   (SSE when "stream": true)
//   GET  /v1/models
//   POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (--allow-runtime-lora; --lora-root)
//   POST /tokenize, /detokenize                            (vLLM's)
//   GET  /health, /metrics, /version
// HTTP threads parse, tokenize and format; they never touch tensors. Each request talks to the
// engine through its own RequestChannel, and a client that disconnects is noticed on the next
// write (SSE events, or heartbeats while nothing is ready) and cancelled in the engine.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/status.h"
#include "runtime/engine.h"
#include "server/openai_protocol.h"

namespace httplib {
class Server;
}

namespace moelora::server {

class ServingTokenizer;
struct ServerState;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0 = any free port (bind() returns it)
  std::string served_model_name;         // the base model's name in the API
  std::string model_path;                // shown as the base model's `root`
  bool allow_runtime_lora = false;       // /v1/load_lora_adapter and /v1/unload_lora_adapter
  size_t max_request_bytes = 32u << 20;  // larger bodies get 413
  int http_threads = 512;                // connections served at once: each open stream holds one
  int listen_backlog = 1024;             // connections waiting to be accepted
  int read_timeout_s = 30;
  int write_timeout_s = 30;              // a client that stops reading is dropped after this
  int keep_alive_timeout_s = 5;
  int keep_alive_max_count = 1000;
  std::chrono::milliseconds heartbeat{500};        // idle streams get an SSE comment this often
  std::chrono::milliseconds nonstream_probe_after{1000};  // then non-streamed answers start probing
  ProtocolLimits limits;
};

class HttpServer {
 public:
  HttpServer(Engine& engine, std::shared_ptr<const ServingTokenizer> tokenizer, ServerOptions options);
  ~HttpServer();

  // Binds the listening socket; returns the port (useful with port 0).
  Result<int> bind();
  // Serves until shutdown()/stop(); blocks the calling thread.
  void serve();
  // Graceful: new generation requests get 503, running ones get up to `grace` to finish, the
  // rest are cancelled (their streams end with an error event), then the server stops.
  void shutdown(std::chrono::milliseconds grace);
  // Immediate stop of the listener (tests).
  void stop();

 private:
  std::unique_ptr<ServerState> state_;
  std::unique_ptr<httplib::Server> http_;
  int listen_fd_ = -1;
};

}  // namespace moelora::server
