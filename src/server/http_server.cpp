#include "server/http_server.h"

#include <sys/resource.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <fmt/format.h>

#include "core/log.h"
#include "server/http_session.h"
#include "server/server_state.h"

namespace moelora::server {

namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

// Cheap routes that never block: they run on the I/O thread and need neither key nor model.
void register_public_routes(Router& router) {
  router.add("GET", "/health", RouteKind::kPublic, [](ServerState& st, const HttpRequest&, HttpResponse& res) {
    if (!st.ready()) return st.send_error(res, {503, "ServiceUnavailableError", "the model is still loading", ""});
    if (st.draining.load()) return st.send_error(res, {503, "ServiceUnavailableError", "the server is shutting down", ""});
    res.status = 200;
  });
  router.add("GET", "/metrics", RouteKind::kPublic, [](ServerState& st, const HttpRequest&, HttpResponse& res) {
    EngineStats stats;
    int loaded = 0;
    if (st.ready()) {
      stats = st.engine().stats();
      loaded = static_cast<int>(st.engine().adapters().size());
    }
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    res.set_content(st.metrics.render(stats, loaded, now), "text/plain; version=0.0.4; charset=utf-8");
  });
  router.add("GET", "/version", RouteKind::kPublic, [](ServerState& st, const HttpRequest&, HttpResponse& res) {
    st.send_json(res, 200, Json{{"version", "0.1.0"}});
  });
}

// Each connection is a file descriptor: the soft limit (often 1024) would cap the streams long
// before --max-connections, so it is raised to the hard limit.
void raise_fd_limit(int wanted) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t want = static_cast<rlim_t>(wanted) + 256;
  if (lim.rlim_cur >= want) return;
  lim.rlim_cur = std::min(want, lim.rlim_max);
  setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace

struct HttpServer::Impl {
  // Destruction runs bottom-up: sessions (held by the pools' and the I/O context's pending
  // handlers) die while the I/O context and the state they use still exist.
  ServerState state;
  Router router;
  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work{ioc.get_executor()};
  net::thread_pool workers;
  net::thread_pool adapters{2};
  ServerCore core;
  tcp::acceptor acceptor{ioc};
  net::steady_timer stats_timer{ioc};
  std::vector<std::thread> threads;
  std::mutex stop_mu;
  std::condition_variable stopped_cv;
  bool stopped = false;
  bool started = false;
  EngineStats last_stats;
  std::chrono::steady_clock::time_point last_stats_at;

  explicit Impl(ServerOptions o)
      : state(std::move(o)),
        workers(static_cast<size_t>(std::max(1, state.options.worker_threads))),
        core(state, router, ioc, workers, adapters) {
    register_public_routes(router);
    register_model_routes(router);
    register_generation_routes(router);
    register_tokenize_routes(router);
  }

  void accept() {
    acceptor.async_accept(net::make_strand(ioc), [this](boost::system::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) {
        boost::system::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);  // SSE events are small and latency matters
        start_session(core, std::move(socket));
      } else {
        // EMFILE and friends: wait a moment instead of spinning on the error.
        MOELORA_LOG_WARN("server: accept failed: {}", ec.message());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      accept();
    });
  }

  // vLLM's periodic line: throughput over the interval and what the engine holds now.
  void schedule_stats() {
    if (state.options.stats_interval.count() <= 0) return;
    stats_timer.expires_after(state.options.stats_interval);
    stats_timer.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      log_stats();
      schedule_stats();
    });
  }

  void log_stats() {
    if (!state.ready()) return;
    const EngineStats s = state.engine().stats();
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - last_stats_at).count();
    const uint64_t prompt = s.prompt_tokens_total - last_stats.prompt_tokens_total;
    const uint64_t gen = s.generation_tokens_total - last_stats.generation_tokens_total;
    const uint64_t queries = s.prefix_cache_queries_total - last_stats.prefix_cache_queries_total;
    const uint64_t hits = s.prefix_cache_hits_total - last_stats.prefix_cache_hits_total;
    const bool active = prompt + gen > 0 || s.num_running > 0 || s.num_waiting > 0;
    last_stats = s;
    last_stats_at = now;
    if (!active || dt <= 0) return;  // an idle server stays quiet
    MOELORA_LOG_INFO("stats: avg prompt throughput: {:.1f} tokens/s, avg generation throughput: {:.1f} tokens/s, "
                     "running: {} reqs, waiting: {} reqs, KV cache usage: {:.1f}%, prefix cache hit rate: {:.1f}%, "
                     "adapter slots: {}/{} ({} loading), open HTTP requests: {}",
                     prompt / dt, gen / dt, s.num_running, s.num_waiting,
                     s.kv_pages_total > 0 ? 100.0 * s.kv_pages_used / s.kv_pages_total : 0.0,
                     queries > 0 ? 100.0 * hits / queries : 0.0, s.lora_slots_used, s.lora_slots_total,
                     s.lora_slots_loading, state.metrics.http_requests_active());
  }
};

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

const ServerOptions& HttpServer::options() const { return impl_->state.options; }

Result<int> HttpServer::start() {
  Impl& m = *impl_;
  const ServerOptions& o = m.state.options;
  boost::system::error_code ec;
  const auto addr = net::ip::make_address(o.host == "localhost" ? "127.0.0.1" : o.host, ec);
  if (ec) return invalid_argument("--host '{}' is not an IP address", o.host);
  const tcp::endpoint ep(addr, static_cast<unsigned short>(o.port));
  m.acceptor.open(ep.protocol(), ec);
  // SO_REUSEADDR only (no SO_REUSEPORT): a second server must not share the port silently.
  if (!ec) m.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(ep, ec);
  if (!ec) m.acceptor.listen(std::max(16, o.listen_backlog), ec);
  if (ec)
    return make_error(ErrorCode::kFailedPrecondition, "cannot listen on {}:{}: {}", o.host, o.port, ec.message());
  raise_fd_limit(o.max_connections);
  const int port = m.acceptor.local_endpoint().port();
  m.last_stats_at = std::chrono::steady_clock::now();
  m.accept();
  m.schedule_stats();
  for (int i = 0; i < std::max(1, o.http_threads); ++i)
    m.threads.emplace_back([&m] {
      // A handler that throws must not take an I/O thread (or the process) down with it.
      for (;;) {
        try {
          m.ioc.run();
          return;
        } catch (const std::exception& e) {
          MOELORA_LOG_ERROR("server: an I/O handler raised: {}", e.what());
        }
      }
    });
  m.started = true;
  return port;
}

void HttpServer::attach(Engine& engine, std::shared_ptr<const ServingTokenizer> tokenizer) {
  impl_->state.attach(engine, std::move(tokenizer));
}

void HttpServer::wait() {
  std::unique_lock<std::mutex> lk(impl_->stop_mu);
  impl_->stopped_cv.wait(lk, [&] { return impl_->stopped; });
}

void HttpServer::shutdown(std::chrono::milliseconds grace) {
  ServerState& st = impl_->state;
  st.draining.store(true);
  if (st.ready()) {
    const auto deadline = std::chrono::steady_clock::now() + grace;
    auto idle = [&] {
      const EngineStats s = st.engine().stats();
      return st.metrics.http_requests_active() == 0 && s.num_running == 0 && s.num_waiting == 0;
    };
    while (!idle() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // Whatever still runs is cancelled; its streams end with an error event.
    st.engine().stop();
    const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (st.metrics.http_requests_active() > 0 && std::chrono::steady_clock::now() < flush_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop();
}

void HttpServer::stop() {
  Impl& m = *impl_;
  if (m.core.stopping.exchange(true)) return wait();  // another thread is stopping it
  net::post(m.ioc, [&m] {
    boost::system::error_code ec;
    m.acceptor.close(ec);
    m.stats_timer.cancel();
  });
  m.core.close_all();
  // Give the sessions a moment to close their sockets on their own strands.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (m.core.connections.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  m.work.reset();
  m.workers.join();
  m.adapters.join();
  m.ioc.stop();
  for (std::thread& t : m.threads)
    if (t.joinable()) t.join();
  {
    std::lock_guard<std::mutex> lk(m.stop_mu);
    m.stopped = true;
  }
  m.stopped_cv.notify_all();
}

}  // namespace moelora::server
