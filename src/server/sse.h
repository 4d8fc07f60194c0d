// Server-sent events as OpenAI-compatible servers write them: every event is one
// `data: <json>\n\n` frame, the stream ends with `data: [DONE]\n\n`, and an error after the
// stream started (the status is already 200) is a `data: {"error": {...}}` frame before [DONE].
// Comment frames (`: ...\n\n`) are ignored by clients; the server sends them as heartbeats on
// idle streams, which keeps proxies from timing the connection out.
#pragma once

#include <string>
#include <string_view>

#include "server/api_error.h"

namespace moelora::server {

inline constexpr std::string_view kSseContentType = "text/event-stream";

std::string sse_data(const Json& event);
std::string sse_data(const OJson& event);
// `payload` must not contain a newline (it would end the field); newlines are escaped as
// "\n" text by the JSON serializer, so only raw strings need care.
std::string sse_data_raw(std::string_view payload);
std::string sse_done();
std::string sse_comment(std::string_view text);

}  // namespace moelora::server
