#include "server/sse.h"

#include "server/api_error.h"

namespace moelora::server {

std::string sse_data(const Json& event) { return sse_data_raw(dump_json(event)); }
std::string sse_data(const OJson& event) { return sse_data_raw(dump_json(event)); }

std::string sse_data_raw(std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 8);
  out += "data: ";
  for (char c : payload) {
    // A bare CR or LF would split the event; JSON text never has them unescaped.
    if (c == '\n' || c == '\r') out += ' ';
    else out += c;
  }
  out += "\n\n";
  return out;
}

std::string sse_done() { return "data: [DONE]\n\n"; }

std::string sse_comment(std::string_view text) {
  std::string out = ": ";
  for (char c : text) out += (c == '\n' || c == '\r') ? ' ' : c;
  out += "\n\n";
  return out;
}

}  // namespace moelora::server
