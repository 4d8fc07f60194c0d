// One HTTP/1.1 connection, served asynchronously on Boost.Beast (internal to src/server).
//
// A session reads a request header first and decides from it alone (Router::admit) whether to
// read the body at all: a refused request never makes the server read or buffer its body. The
// body is then read under the byte limit (Content-Length checked up front, chunked bodies
// counted as they arrive), an idle deadline (no byte for read_idle_timeout) and a whole-request
// deadline (request_timeout). Requests on one connection are answered in order, so pipelined
// requests wait in the read buffer (bounded) for their turn.
//
// While a handler or a generation runs, the session keeps one read pending on the socket: a
// client that closes its connection is noticed at once and its request is cancelled, without
// writing anything. That is what lets a non-streamed response keep its status until the result
// is known (an error is a real 4xx/5xx, not an error body after "200").
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/thread_pool.hpp>

#include "server/server_state.h"

namespace moelora::server {

class Session;

// What all sessions of one server share; outlives them (HttpServer::Impl owns it).
struct ServerCore {
  ServerState& state;
  const Router& router;
  boost::asio::io_context& ioc;
  boost::asio::thread_pool& workers;   // RouteKind::kApi handlers
  boost::asio::thread_pool& adapters;  // RouteKind::kAdapterAdmin handlers
  std::atomic<int> connections{0};
  std::atomic<bool> stopping{false};

  // Live sessions, so that stop() can close them.
  std::mutex sessions_mu;
  std::unordered_map<Session*, std::weak_ptr<Session>> sessions;

  ServerCore(ServerState& s, const Router& r, boost::asio::io_context& io, boost::asio::thread_pool& w,
             boost::asio::thread_pool& a)
      : state(s), router(r), ioc(io), workers(w), adapters(a) {}
  void close_all();
};

// Starts serving an accepted socket (its executor must be a strand). Connections beyond
// --max-connections get a 503 and are closed.
void start_session(ServerCore& core, boost::asio::ip::tcp::socket socket);

}  // namespace moelora::server
