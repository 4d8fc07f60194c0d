// The request and response every endpoint sees, independent of the HTTP library underneath
// (http_session.cpp speaks HTTP/1.1 with Boost.Beast). A handler fills an HttpResponse; a
// generation hands the session a GenerationLease instead of a body, and the session then drives
// the job (SSE chunks as they come, or one JSON object once it is finished).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moelora::server {

class GenerationLease;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent, query included
  std::string path;    // target without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, in order
  std::string body;
  std::string request_id;  // X-Request-Id as sent (when printable and short), else a fresh one
  std::chrono::steady_clock::time_point arrival;

  // The first value of a header (name in lower case), "" when absent.
  std::string_view header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
      if (k == lower_name) return v;
    return {};
  }
  bool has_header(std::string_view lower_name) const {
    for (const auto& [k, v] : headers)
      if (k == lower_name) return true;
    return false;
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // Set by the generation endpoints: the session answers from the running job instead of body.
  std::shared_ptr<GenerationLease> generation;

  void set_content(std::string b, std::string_view type) {
    body = std::move(b);
    content_type = std::string(type);
  }
  void set_header(std::string name, std::string value) { headers.emplace_back(std::move(name), std::move(value)); }
};

}  // namespace moelora::server
