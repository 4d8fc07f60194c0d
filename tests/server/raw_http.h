// Raw-socket HTTP for the server tests: what a client library would hide (bytes on the wire,
// timing, half-sent requests, pipelining, connections dropped at will), plus an in-process
// server over the bundled tiny model.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/engine.h"
#include "server/http_server.h"
#include "server/serving_tokenizer.h"

namespace moelora::server::testing {

// A loopback TCP connection (blocking, reads time out after `timeout`).
class RawConn {
 public:
  explicit RawConn(int port, std::chrono::milliseconds timeout = std::chrono::seconds(20));
  ~RawConn();
  RawConn(const RawConn&) = delete;
  RawConn& operator=(const RawConn&) = delete;
  bool ok() const { return fd_ >= 0; }
  // False when the peer closed or reset the connection.
  bool send(std::string_view bytes);
  void close();

  struct Response {
    int status = 0;  // 0: the connection ended before a status line
    std::string head;
    std::string body;  // de-chunked
    std::string header(const std::string& lower_name) const;
  };
  // Reads one whole response (Content-Length, chunked, or until close). Interim 1xx answers
  // are skipped unless `skip_interim` is false.
  Response read_response(bool skip_interim = true);
  // True when bytes (or EOF) can be read within `timeout`.
  bool readable(std::chrono::milliseconds timeout);
  // True when the peer closed the connection (EOF or reset) within `timeout`.
  bool closed_by_peer(std::chrono::milliseconds timeout);

 private:
  bool fill();  // reads more into buf_; false on EOF/error/timeout
  int fd_ = -1;
  std::string buf_;
};

std::string post_json(const std::string& path, const std::string& body, const std::string& extra_headers = "");
std::string get_req(const std::string& path, const std::string& extra_headers = "");

// The bundled tiny model on the CPU, with its two adapters, behind an HttpServer on a free port.
class TinyServer {
 public:
  explicit TinyServer(ServerOptions options, EngineOptions engine_options = {}, bool attach = true);
  ~TinyServer();
  void attach();
  int port() const { return port_; }
  Engine& engine() { return *engine_; }
  HttpServer& http() { return *http_; }
  // One request on a fresh connection.
  RawConn::Response call(const std::string& request);

 private:
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const ServingTokenizer> tokenizer_;
  std::unique_ptr<HttpServer> http_;
  int port_ = 0;
};

std::string tiny_model_dir();
// The value of a /metrics sample (the first whose name is `name`), -1 when absent.
double metric(int port, const std::string& name);
// The metric's value once it equals `expected`, or its last value when `within` ran out. A
// response is complete for the client a moment before the server's bookkeeping of it ends (the
// open-request count drops after the last write completes), so counts are read this way.
double metric_settled(int port, const std::string& name, double expected,
                      std::chrono::milliseconds within = std::chrono::seconds(10));

}  // namespace moelora::server::testing
