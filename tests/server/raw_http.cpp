#include "tests/server/raw_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backends/cpu/cpu_backend.h"
#include "model/model.h"

namespace moelora::server::testing {

RawConn::RawConn(int port, std::chrono::milliseconds timeout) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) close();
}

RawConn::~RawConn() { close(); }

void RawConn::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool RawConn::send(std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

bool RawConn::fill() {
  char tmp[65536];
  for (;;) {
    const ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    buf_.append(tmp, static_cast<size_t>(n));
    return true;
  }
}

bool RawConn::readable(std::chrono::milliseconds timeout) {
  if (!buf_.empty()) return true;
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) > 0;
}

bool RawConn::closed_by_peer(std::chrono::milliseconds timeout) {
  pollfd p{fd_, POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (::poll(&p, 1, std::max(1, left)) <= 0) continue;
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK);
    if (n <= 0) return true;
    buf_.clear();
    char tmp[4096];
    if (::recv(fd_, tmp, sizeof(tmp), 0) <= 0) return true;  // drain what the server still said
  }
  return false;
}

std::string RawConn::Response::header(const std::string& lower_name) const {
  size_t pos = 0;
  while ((pos = head.find("\r\n", pos)) != std::string::npos) {
    pos += 2;
    const size_t colon = head.find(':', pos);
    const size_t eol = head.find("\r\n", pos);
    if (colon == std::string::npos || eol == std::string::npos || colon > eol) continue;
    std::string name = head.substr(pos, colon - pos);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name == lower_name) {
      size_t v = colon + 1;
      while (v < eol && head[v] == ' ') ++v;
      return head.substr(v, eol - v);
    }
  }
  return "";
}

RawConn::Response RawConn::read_response(bool skip_interim) {
  Response r;
  size_t end;
  while ((end = buf_.find("\r\n\r\n")) == std::string::npos)
    if (!fill()) return r;
  r.head = buf_.substr(0, end + 2);
  buf_.erase(0, end + 4);
  if (r.head.size() > 12) r.status = std::atoi(r.head.c_str() + 9);
  if (r.status >= 100 && r.status < 200) return skip_interim ? read_response() : r;
  const std::string te = r.header("transfer-encoding");
  const std::string cl = r.header("content-length");
  if (te == "chunked") {
    for (;;) {
      size_t eol;
      while ((eol = buf_.find("\r\n")) == std::string::npos)
        if (!fill()) return r;
      const size_t size = std::stoul(buf_.substr(0, eol), nullptr, 16);
      while (buf_.size() < eol + 2 + size + 2)
        if (!fill()) return r;
      r.body += buf_.substr(eol + 2, size);
      buf_.erase(0, eol + 2 + size + 2);
      if (size == 0) break;
    }
  } else if (!cl.empty()) {
    const size_t n = std::stoul(cl);
    while (buf_.size() < n)
      if (!fill()) break;
    r.body = buf_.substr(0, std::min(n, buf_.size()));
    buf_.erase(0, r.body.size());
  } else {
    while (fill()) {
    }
    r.body = std::move(buf_);
    buf_.clear();
  }
  return r;
}

std::string post_json(const std::string& path, const std::string& body, const std::string& extra_headers) {
  return fmt::format("POST {} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n{}",
                     path, body.size(), extra_headers, body);
}

std::string get_req(const std::string& path, const std::string& extra_headers) {
  return fmt::format("GET {} HTTP/1.1\r\nHost: 127.0.0.1\r\n{}\r\n", path, extra_headers);
}

std::string tiny_model_dir() { return std::string(MOELORA_SOURCE_DIR) + "/models/tiny-qwen3moe"; }

TinyServer::TinyServer(ServerOptions options, EngineOptions engine_options, bool attach_now) {
  auto backend = std::make_unique<CpuBackend>();
  auto model = Model::load(tiny_model_dir(), *backend);
  EXPECT_TRUE(model.ok()) << model.status().message();
  if (engine_options.max_model_len == 0) engine_options.max_model_len = 256;
  auto e = Engine::create(std::move(backend), std::move(model).value(), engine_options);
  EXPECT_TRUE(e.ok()) << e.status().message();
  engine_ = std::move(e).value();
  for (const char* a : {"attn-r8", "full-r16"})
    EXPECT_TRUE(engine_->load_adapter(a, tiny_model_dir() + "/adapters/" + a).ok());
  auto tok = ServingTokenizer::load(tiny_model_dir());
  EXPECT_TRUE(tok.ok());
  tokenizer_ = std::move(tok).value();
  options.port = 0;
  if (options.served_model_name.empty()) options.served_model_name = "tiny-qwen3moe";
  options.stats_interval = std::chrono::milliseconds(0);
  http_ = std::make_unique<HttpServer>(options);
  auto port = http_->start();
  EXPECT_TRUE(port.ok()) << port.status().message();
  port_ = port.ok() ? *port : 0;
  if (attach_now) attach();
}

TinyServer::~TinyServer() {
  http_.reset();  // before the engine: open responses cancel their requests in it
  engine_.reset();
}

void TinyServer::attach() { http_->attach(*engine_, tokenizer_); }

RawConn::Response TinyServer::call(const std::string& request) {
  RawConn c(port_);
  EXPECT_TRUE(c.ok());
  c.send(request);
  return c.read_response();
}

double metric(int port, const std::string& name) {
  RawConn c(port);
  c.send(get_req("/metrics"));
  const RawConn::Response r = c.read_response();
  size_t pos = 0;
  while (pos < r.body.size()) {
    const size_t eol = r.body.find('\n', pos);
    const std::string line = r.body.substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
    pos = eol == std::string::npos ? r.body.size() : eol + 1;
    if (line.rfind(name, 0) == 0 && (line.size() > name.size()) && (line[name.size()] == '{' || line[name.size()] == ' '))
      return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

double metric_settled(int port, const std::string& name, double expected, std::chrono::milliseconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  double v = metric(port, name);
  while (v != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    v = metric(port, name);
  }
  return v;
}

}  // namespace moelora::server::testing
