#include "server/http_session.h"

#include <algorithm>
#include <optional>
#include <random>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "core/log.h"
#include "server/generation_job.h"
#include "server/sse.h"

namespace moelora::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using SteadyClock = std::chrono::steady_clock;

namespace {

// Pipelined bytes buffered while a request is answered; beyond this the session stops reading
// until the current response is done (the client waits; nothing grows without bound).
constexpr size_t kPipelineBufferBytes = 64u << 10;
// After a response that closes the connection, unread request bytes are drained for this long
// before the socket closes, so that the client reads the response instead of a reset.
constexpr auto kLingerTime = std::chrono::milliseconds(1000);
constexpr size_t kLingerBytes = 1u << 20;

std::string str(beast::string_view v) { return std::string(v.data(), v.size()); }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// X-Request-Id is echoed in a header and written to the log: only short printable values are
// taken as sent; anything else gets a fresh id.
std::string request_id_from(std::string_view sent) {
  const bool ok = !sent.empty() && sent.size() <= 128 &&
                  std::all_of(sent.begin(), sent.end(), [](char c) { return c > 0x20 && c < 0x7f; });
  if (ok) return std::string(sent);
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:016x}{:016x}", rng(), rng());
}

}  // namespace

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ServerCore& core, tcp::socket socket)
      : core_(core), opts_(core.state.options), socket_(std::move(socket)), deadline_timer_(socket_.get_executor()),
        tick_timer_(socket_.get_executor()), buffer_(opts_.max_header_bytes + kPipelineBufferBytes) {
    core_.connections.fetch_add(1);
  }
  ~Session() {
    core_.connections.fetch_sub(1);
    std::lock_guard<std::mutex> lk(core_.sessions_mu);
    core_.sessions.erase(this);
  }

  void start() {
    {
      std::lock_guard<std::mutex> lk(core_.sessions_mu);
      core_.sessions.emplace(this, weak_from_this());
    }
    net::dispatch(socket_.get_executor(), [self = shared_from_this()] {
      if (self->core_.connections.load() > self->opts_.max_connections) {
        self->version_ = 11;
        self->write_error({503, "ServiceUnavailableError",
                           fmt::format("the server is at its limit of {} connections", self->opts_.max_connections), ""},
                          /*close_after=*/true);
        return;
      }
      self->read_request();
    });
  }

  // Any thread.
  void close() {
    net::post(socket_.get_executor(), [self = shared_from_this()] { self->do_close(); });
  }

 private:
  enum class Phase { kReading, kHandling, kGenerating, kWriting, kLingering };

  // ---- reading a request ------------------------------------------------------------------
  void read_request() {
    if (closed_) return;
    if (core_.stopping.load()) return do_close();
    phase_ = Phase::kReading;
    req_ = HttpRequest();
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(std::min<size_t>(opts_.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(opts_.max_request_bytes);
    got_header_ = false;
    timed_out_ = false;
    started_ = buffer_.size() > 0;
    const auto now = SteadyClock::now();
    request_deadline_ = now + opts_.request_timeout;
    set_deadline(started_ ? std::min(now + opts_.read_idle_timeout, request_deadline_) : now + opts_.keep_alive_timeout);
    read_more();
  }

  // Reads raw bytes and feeds the parser ourselves (rather than http::async_read_some, which
  // keeps reading until the header is complete): every read gets the idle deadline, capped by
  // the whole-request one, and a slow sender cannot hold a connection past them.
  void read_more() {
    if (!parse_buffered()) return;
    const size_t room = buffer_.max_size() - buffer_.size();
    if (room == 0)  // more unparsed bytes than a header may have
      return write_error({431, "RequestHeaderFieldsTooLargeError",
                          fmt::format("the request line and headers are larger than {} bytes", opts_.max_header_bytes),
                          ""},
                         true);
    socket_.async_read_some(buffer_.prepare(std::min<size_t>(room, 64u << 10)),
                            [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_read(ec, n); });
  }

  // Parses what is buffered. False when the request is complete or answered (nothing more to
  // read for now), true when more bytes are needed.
  bool parse_buffered() {
    while (buffer_.size() > 0) {
      beast::error_code ec;
      const size_t used = parser_->put(buffer_.data(), ec);
      buffer_.consume(used);
      if (ec == http::error::need_more) return true;
      if (ec) {
        on_read_error(ec);
        return false;
      }
      if (!got_header_ && parser_->is_header_done()) {
        got_header_ = true;
        if (!on_header()) return false;
      }
      if (parser_->is_done()) {
        on_request();
        return false;
      }
      if (used == 0) return true;
    }
    return true;
  }

  void on_read(beast::error_code ec, size_t n) {
    if (closed_) return;
    if (timed_out_) {
      // The deadline cancelled the read: a request that had begun gets its 408.
      if (started_) return write_error({408, "RequestTimeoutError", "the request did not arrive in time", ""}, true);
      return do_close();
    }
    if (ec) return on_read_error(ec);
    buffer_.commit(n);
    const auto now = SteadyClock::now();
    if (!started_) {
      started_ = true;
      request_deadline_ = now + opts_.request_timeout;
    }
    set_deadline(std::min(now + opts_.read_idle_timeout, request_deadline_));
    read_more();
  }

  void on_read_error(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == http::error::partial_message || ec == net::error::eof ||
        ec == net::error::operation_aborted || ec == net::error::connection_reset)
      return do_close();
    if (ec == http::error::body_limit)
      return write_error({413, "RequestTooLargeError",
                          fmt::format("the request body is larger than the limit of {} bytes (--max-request-bytes)",
                                      opts_.max_request_bytes),
                          ""},
                         true);
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
      return write_error({431, "RequestHeaderFieldsTooLargeError",
                          fmt::format("the request line and headers are larger than {} bytes", opts_.max_header_bytes),
                          ""},
                         true);
    if (ec.category() == http::make_error_code(http::error::bad_target).category())
      return write_error(bad_request(fmt::format("malformed HTTP request: {}", ec.message())), true);
    do_close();
  }

  // The header is complete: admit or refuse the request before reading its body.
  bool on_header() {
    const auto& h = parser_->get();
    version_ = h.version();
    req_ = HttpRequest();
    req_.arrival = SteadyClock::now();
    req_.method = str(h.method_string());
    req_.target = str(h.target());
    req_.path = req_.target.substr(0, req_.target.find('?'));
    int count = 0;
    for (const auto& f : h) {
      req_.headers.emplace_back(lower(str(f.name_string())), str(f.value()));
      ++count;
    }
    req_.request_id = request_id_from(req_.header("x-request-id"));
    if (count > opts_.max_header_count) {
      write_error({431, "RequestHeaderFieldsTooLargeError",
                   fmt::format("the request has {} header fields; at most {} are accepted", count, opts_.max_header_count),
                   ""},
                  true);
      return false;
    }
    if (auto e = core_.router.admit(core_.state, req_, &route_)) {
      // The body (if any) is never read, so its bytes cannot be told from a next request: the
      // connection closes after the answer unless the request has no body at all.
      const auto length = parser_->content_length();
      const bool has_body = parser_->chunked() || (length && *length > 0);
      write_error(*e, has_body);
      return false;
    }
    if (!parser_->is_done() && lower(req_.header("expect")) == "100-continue") {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(socket_, net::buffer(kContinue), [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec || self->closed_) return self->do_close();
        self->read_more();
      });
      return false;
    }
    return true;
  }

  void on_request() {
    clear_deadline();
    auto msg = parser_->release();
    keep_alive_ = msg.keep_alive();
    req_.body = std::move(msg.body());
    dispatch();
  }

  // ---- running the handler ------------------------------------------------------------------
  static void run_handler(ServerState& st, const Route& route, const HttpRequest& req, HttpResponse& res) {
    try {
      route.handler(st, req, res);
    } catch (const std::exception& e) {
      MOELORA_LOG_ERROR("server: {} {} raised: {}", req.method, req.path, e.what());
      res = HttpResponse();
      st.send_error(res, internal_error(std::string("internal error: ") + e.what()));
    } catch (...) {
      res = HttpResponse();
      st.send_error(res, internal_error("internal error"));
    }
  }

  void dispatch() {
    phase_ = Phase::kHandling;
    watch();
    const Route* route = route_;
    if (route->kind == RouteKind::kPublic) {
      HttpResponse res;
      run_handler(core_.state, *route, req_, res);
      return on_handled(std::move(res));
    }
    auto& pool = route->kind == RouteKind::kAdapterAdmin ? core_.adapters : core_.workers;
    net::post(pool, [self = shared_from_this(), route] {
      HttpResponse res;
      run_handler(self->core_.state, *route, self->req_, res);
      net::post(self->socket_.get_executor(),
                [self, res = std::move(res)]() mutable { self->on_handled(std::move(res)); });
    });
  }

  void on_handled(HttpResponse res) {
    if (closed_) return;  // the client left meanwhile; a generation's lease dies here and cancels it
    if (res.generation) {
      lease_ = std::move(res.generation);
      return start_generation();
    }
    write_response(std::move(res), !keep_alive_);
  }

  // ---- whole responses ----------------------------------------------------------------------
  void write_error(const ApiError& e, bool close_after) {
    HttpResponse res;
    core_.state.send_error(res, e);
    write_response(std::move(res), close_after);
  }

  void write_response(HttpResponse res, bool close_after) {
    if (closed_) return;
    close_after = close_after || core_.stopping.load();
    phase_ = Phase::kWriting;
    if (res.status >= 400) core_.state.metrics.count_rejected(res.status);
    auto msg = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(res.status), version_);
    msg->set(http::field::server, "moelora");
    if (!res.content_type.empty()) msg->set(http::field::content_type, res.content_type);
    if (!req_.request_id.empty()) msg->set("X-Request-Id", req_.request_id);
    for (const auto& [k, v] : res.headers) msg->set(k, v);
    msg->body() = std::move(res.body);
    msg->keep_alive(!close_after);
    msg->prepare_payload();
    MOELORA_LOG_DEBUG("http: {} {} -> {} ({} bytes)", req_.method, req_.path, res.status, msg->body().size());
    writing_ = true;
    set_deadline(SteadyClock::now() + opts_.write_timeout);
    http::async_write(socket_, *msg, [self = shared_from_this(), msg, close_after](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->clear_deadline();
      if (ec) return self->do_close();
      if (close_after) return self->linger_close();
      self->next_request();
    });
  }

  // ---- generations --------------------------------------------------------------------------
  void start_generation() {
    phase_ = Phase::kGenerating;
    GenerationJob& job = lease_->job();
    streaming_ = job.spec().opts.stream;
    std::weak_ptr<Session> weak = weak_from_this();
    job.set_listener([weak] {
      if (auto s = weak.lock()) s->wake();
    });
    start_ticker();
    if (!streaming_) return on_wake();
    // The stream's head: chunked under HTTP/1.1; HTTP/1.0 clients read until the connection closes.
    chunked_ = version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    auto head = std::make_shared<http::response<http::empty_body>>(http::status::ok, version_);
    head->set(http::field::server, "moelora");
    head->set(http::field::content_type, kSseContentType);
    head->set(http::field::cache_control, "no-cache");
    head->set("X-Accel-Buffering", "no");  // proxies must not buffer the stream
    if (!req_.request_id.empty()) head->set("X-Request-Id", req_.request_id);
    head->keep_alive(keep_alive_);
    if (chunked_) head->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*head);
    writing_ = true;
    set_deadline(SteadyClock::now() + opts_.write_timeout);
    http::async_write_header(socket_, *sr, [self = shared_from_this(), head, sr](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->clear_deadline();
      if (ec) return self->do_close();
      self->last_write_ = SteadyClock::now();
      self->pump_stream();
    });
  }

  // Any thread (the engine's, through the RequestChannel): one post per burst of deliveries.
  void wake() {
    if (wake_pending_.exchange(true)) return;
    net::post(socket_.get_executor(), [self = shared_from_this()] {
      self->wake_pending_.store(false);
      self->on_wake();
    });
  }

  void on_wake() {
    if (closed_ || !lease_) return;
    if (streaming_) return pump_stream();
    std::string unused;
    if (!lease_->job().pump(std::chrono::milliseconds(0), &unused)) return;
    // Finished: the status is the outcome's (an error is a real error status, never 200).
    GenerationJob& job = lease_->job();
    HttpResponse res;
    res.status = job.final_status();
    res.set_content(job.final_body(), "application/json");
    if (res.status == 503 || res.status == 429) res.set_header("Retry-After", "1");
    lease_->set_http_status(res.status);
    lease_.reset();
    tick_timer_.cancel();
    write_response(std::move(res), !keep_alive_);
  }

  void pump_stream() {
    if (writing_ || closed_ || !lease_) return;
    std::string out;
    const bool done = lease_->job().pump(std::chrono::milliseconds(0), &out);
    if (out.empty() && !done) return;
    write_stream(std::move(out), done);
  }

  void write_stream(std::string data, bool last) {
    writing_ = true;
    out_ = std::move(data);
    set_deadline(SteadyClock::now() + opts_.write_timeout);
    auto done = [self = shared_from_this(), last](beast::error_code ec, size_t) { self->on_stream_written(ec, last, false); };
    if (!chunked_) return net::async_write(socket_, net::buffer(out_), std::move(done));
    if (out_.empty()) return on_stream_written({}, last, false);
    net::async_write(socket_, http::make_chunk(net::buffer(out_)), std::move(done));
  }

  void on_stream_written(beast::error_code ec, bool last, bool terminated) {
    writing_ = false;
    clear_deadline();
    if (ec || closed_) return client_gone();
    last_write_ = SteadyClock::now();
    if (!last) return pump_stream();
    if (chunked_ && !terminated) {
      writing_ = true;
      set_deadline(SteadyClock::now() + opts_.write_timeout);
      return net::async_write(socket_, http::make_chunk_last(), [self = shared_from_this()](beast::error_code e, size_t) {
        self->on_stream_written(e, true, true);
      });
    }
    lease_->set_http_status(200);
    lease_.reset();
    tick_timer_.cancel();
    if (!chunked_ || !keep_alive_ || core_.stopping.load()) return linger_close();
    next_request();
  }

  // Heartbeats keep idle streams alive through proxies; each tick also polls the job, which
  // covers a wake-up that raced with the listener being installed.
  void start_ticker() {
    tick_timer_.expires_after(opts_.heartbeat);
    tick_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec || self->closed_ || !self->lease_) return;
      if (self->streaming_ && !self->writing_ && SteadyClock::now() - self->last_write_ >= self->opts_.heartbeat) {
        self->write_stream(sse_comment("keep-alive"), false);
      } else {
        self->on_wake();
      }
      if (self->lease_) self->start_ticker();
    });
  }

  // ---- the connection between and after requests ---------------------------------------------
  // One read stays pending while a request is answered: EOF or a reset means the client is
  // gone; bytes are the next pipelined request, kept for later.
  void watch() {
    if (watching_ || closed_) return;
    if (buffer_.size() >= kPipelineBufferBytes) return;
    watching_ = true;
    auto space = buffer_.prepare(std::min<size_t>(4096, buffer_.max_size() - buffer_.size()));
    socket_.async_read_some(space, [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->on_watch(ec, n);
    });
  }

  void on_watch(beast::error_code ec, size_t n) {
    watching_ = false;
    if (closed_) return;
    if (phase_ == Phase::kLingering) {
      if (ec) return do_close();
      buffer_.consume(buffer_.size());
      return linger_read();
    }
    if (!ec) buffer_.commit(n);
    if (ec && ec != net::error::operation_aborted) return client_gone();
    if (resume_after_watch_) {
      resume_after_watch_ = false;
      return read_request();
    }
    if (ec) return;
    if (phase_ != Phase::kReading && phase_ != Phase::kLingering) watch();
  }

  void client_gone() {
    if (lease_) MOELORA_LOG_DEBUG("http: {} {}: the client went away; cancelling", req_.method, req_.path);
    do_close();
  }

  void next_request() {
    if (closed_) return;
    if (watching_) {
      // The watch read shares the buffer with the parser: let it finish first.
      resume_after_watch_ = true;
      beast::error_code ec;
      socket_.cancel(ec);
      return;
    }
    read_request();
  }

  void linger_close() {
    if (closed_) return;
    phase_ = Phase::kLingering;
    lease_.reset();
    beast::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return do_close();
    linger_left_ = kLingerBytes;
    set_deadline(SteadyClock::now() + kLingerTime);
    if (!watching_) linger_read();  // else the pending watch read continues into linger_read
  }

  void linger_read() {
    socket_.async_read_some(net::buffer(linger_buf_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec || self->closed_ || n >= self->linger_left_) return self->do_close();
      self->linger_left_ -= n;
      self->linger_read();
    });
  }

  void do_close() {
    if (closed_) return;
    closed_ = true;
    lease_.reset();  // cancels what still runs in the engine
    beast::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    deadline_timer_.cancel();
    tick_timer_.cancel();
  }

  // ---- deadlines ------------------------------------------------------------------------------
  void set_deadline(SteadyClock::time_point t) {
    deadline_ = t;
    deadline_timer_.expires_at(t);
    deadline_timer_.async_wait([self = shared_from_this()](beast::error_code ec) { self->on_deadline(ec); });
  }
  void clear_deadline() {
    deadline_ = SteadyClock::time_point::max();
    deadline_timer_.cancel();
  }
  void on_deadline(beast::error_code ec) {
    if (ec || closed_ || SteadyClock::now() < deadline_) return;  // cancelled or moved later
    if (phase_ == Phase::kReading) {
      timed_out_ = true;
      beast::error_code ignored;
      socket_.cancel(ignored);  // on_read answers 408 (or just closes an idle connection)
      return;
    }
    do_close();  // a write or the lingering close took too long
  }

  ServerCore& core_;
  const ServerOptions& opts_;
  tcp::socket socket_;
  net::steady_timer deadline_timer_;
  net::steady_timer tick_timer_;
  SteadyClock::time_point deadline_ = SteadyClock::time_point::max();
  SteadyClock::time_point request_deadline_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequest req_;
  const Route* route_ = nullptr;
  Phase phase_ = Phase::kReading;
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool got_header_ = false;
  bool started_ = false;
  bool timed_out_ = false;
  bool watching_ = false;
  bool resume_after_watch_ = false;
  bool writing_ = false;
  bool closed_ = false;
  // generation
  std::shared_ptr<GenerationLease> lease_;
  bool streaming_ = false;
  bool chunked_ = true;
  std::string out_;
  std::atomic<bool> wake_pending_{false};
  SteadyClock::time_point last_write_;
  // lingering close
  std::array<char, 4096> linger_buf_{};
  size_t linger_left_ = 0;
};

void ServerCore::close_all() {
  std::vector<std::shared_ptr<Session>> live;
  {
    std::lock_guard<std::mutex> lk(sessions_mu);
    for (auto& [p, w] : sessions)
      if (auto s = w.lock()) live.push_back(std::move(s));
  }
  for (auto& s : live) s->close();
}

void start_session(ServerCore& core, tcp::socket socket) {
  std::make_shared<Session>(core, std::move(socket))->start();
}

}  // namespace moelora::server
