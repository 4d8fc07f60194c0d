#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "core/log.h"
#include "server/server_state.h"

namespace moelora::server {

ServerState::ServerState(Engine& e, std::shared_ptr<const ServingTokenizer> t, ServerOptions o)
    : engine(e), tokenizer(std::move(t)), options(std::move(o)),
      metrics(options.served_model_name, e.options().max_loras_per_batch) {}

std::optional<ApiError> ServerState::resolve_model(const std::string& model, const std::optional<std::string>& lora_path,
                                                   std::string* adapter) const {
  const std::string& base = options.served_model_name;
  std::string from_model;  // adapter named by `model`, if any
  bool model_is_base = model.empty() || model == base;
  if (!model_is_base) {
    if (engine.has_adapter(model)) {
      from_model = model;
    } else {
      // sglang: "base-model:adapter-name" (adapter names cannot contain ':').
      const size_t colon = model.rfind(':');
      if (colon == std::string::npos || model.substr(0, colon) != base) return model_not_found(model);
      from_model = model.substr(colon + 1);
      if (from_model.empty()) {
        model_is_base = true;
      } else if (!engine.has_adapter(from_model)) {
        return model_not_found(model);
      }
    }
  }
  if (lora_path && !lora_path->empty()) {
    // sglang's explicit field names the adapter; `model` must then be the base or agree.
    if (!from_model.empty() && from_model != *lora_path)
      return bad_request(fmt::format("'lora_path' ({}) and 'model' ({}) name different adapters", *lora_path, model),
                         "lora_path");
    if (!engine.has_adapter(*lora_path))
      return ApiError{404, "NotFoundError", fmt::format("The model `{}` does not exist.", *lora_path), "lora_path"};
    *adapter = *lora_path;
    return std::nullopt;
  }
  *adapter = from_model;
  return std::nullopt;
}

void ServerState::send_error(httplib::Response& res, const ApiError& error) {
  metrics.count_rejected(error.http_status);
  res.status = error.http_status;
  res.set_content(error.body(), "application/json");
  if (error.http_status == 503 || error.http_status == 429) res.set_header("Retry-After", "1");
}

void ServerState::send_json(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void ServerState::send_json(httplib::Response& res, int status, const OJson& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

HttpServer::HttpServer(Engine& engine, std::shared_ptr<const ServingTokenizer> tokenizer, ServerOptions options)
    : state_(std::make_unique<ServerState>(engine, std::move(tokenizer), std::move(options))),
      http_(std::make_unique<httplib::Server>()) {
  ServerState& st = *state_;
  httplib::Server& h = *http_;
  const ServerOptions& o = st.options;
  // Every open stream holds a pool thread for its whole life (cpp-httplib is thread per
  // connection), so the pool is sized for the streams we mean to serve at once.
  const int threads = std::max(4, o.http_threads);
  h.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  h.set_read_timeout(o.read_timeout_s, 0);
  h.set_write_timeout(o.write_timeout_s, 0);
  h.set_keep_alive_timeout(o.keep_alive_timeout_s);
  h.set_keep_alive_max_count(static_cast<size_t>(o.keep_alive_max_count));
  h.set_payload_max_length(o.max_request_bytes);
  // cpp-httplib 0.11 listens with a backlog of 5, so a burst of clients (hundreds of streams
  // opened at once) overflows the accept queue and connections stall or get reset. We keep the
  // listening socket's descriptor here and raise the backlog after bind (listen() may be called
  // again on a listening socket). SO_REUSEADDR only: the library's default SO_REUSEPORT would
  // let a second server bind the same port silently.
  h.set_socket_options([this](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd_ = sock;
  });

  // Errors cpp-httplib produces itself (unknown route, 413, 400 on a broken request line) get
  // the same JSON envelope as ours; responses that already carry a body are left alone.
  h.set_error_handler([&st](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.is_chunked_content_provider_ || res.content_provider_) return;
    ApiError e;
    e.http_status = res.status;
    e.type = error_type_for(res.status);
    if (res.status == 404) e.message = fmt::format("Not Found: {} {}", req.method, req.path);
    else if (res.status == 413)
      e.message = fmt::format("the request body is larger than the limit of {} bytes", st.options.max_request_bytes);
    else e.message = fmt::format("HTTP {}", res.status);
    st.metrics.count_rejected(res.status);
    res.set_content(e.body(), "application/json");
  });
  h.set_exception_handler([&st](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    MOELORA_LOG_ERROR("server: {} {} raised: {}", req.method, req.path, what);
    st.send_error(res, internal_error("internal error: " + what));
  });
  h.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    MOELORA_LOG_DEBUG("http: {} {} -> {}", req.method, req.path, res.status);
  });

  h.Get("/health", [&st](const httplib::Request&, httplib::Response& res) {
    if (st.draining.load()) {
      st.send_error(res, {503, "ServiceUnavailableError", "the server is shutting down", ""});
      return;
    }
    res.status = 200;
  });
  h.Get("/metrics", [&st](const httplib::Request&, httplib::Response& res) {
    const EngineStats stats = st.engine.stats();
    const int loaded = static_cast<int>(st.engine.adapters().size());
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    res.set_content(st.metrics.render(stats, loaded, now), "text/plain; version=0.0.4; charset=utf-8");
  });
  h.Get("/version", [&st](const httplib::Request&, httplib::Response& res) {
    st.send_json(res, 200, Json{{"version", "0.1.0"}});
  });
  register_model_routes(h, st);
  register_generation_routes(h, st);
  register_tokenize_routes(h, st);
}

HttpServer::~HttpServer() { stop(); }

Result<int> HttpServer::bind() {
  const ServerOptions& o = state_->options;
  int port = o.port;
  if (port == 0) {
    port = http_->bind_to_any_port(o.host);
    if (port <= 0) return make_error(ErrorCode::kFailedPrecondition, "cannot listen on {} (any port)", o.host);
  } else if (!http_->bind_to_port(o.host, port)) {
    return make_error(ErrorCode::kFailedPrecondition, "cannot listen on {}:{} (in use, or not allowed)", o.host, port);
  }
  if (listen_fd_ >= 0) ::listen(listen_fd_, std::max(16, o.listen_backlog));
  return port;
}

void HttpServer::serve() { http_->listen_after_bind(); }

void HttpServer::shutdown(std::chrono::milliseconds grace) {
  ServerState& st = *state_;
  st.draining.store(true);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  auto idle = [&] {
    const EngineStats s = st.engine.stats();
    return st.metrics.http_requests_active() == 0 && s.num_running == 0 && s.num_waiting == 0;
  };
  while (!idle() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // Whatever still runs is cancelled; its streams end with an error event.
  st.engine.stop();
  const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (st.metrics.http_requests_active() > 0 && std::chrono::steady_clock::now() < flush_deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  http_->stop();
}

void HttpServer::stop() {
  if (http_) http_->stop();
}

}  // namespace moelora::server
