#include "server/stop_strings.h"

#include <algorithm>

namespace moelora::server {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops, bool include_stop) : include_stop_(include_stop) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

StopStringMatcher::Output StopStringMatcher::feed(std::string_view text) {
  Output out;
  if (stopped_) return out;
  if (stops_.empty()) {
    out.text.assign(text);
    return out;
  }
  held_.append(text);
  // The earliest match wins (ties: the longer stop string, which contains the shorter one's
  // text only when it starts at the same place).
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at == std::string::npos) continue;
    if (at < best || (at == best && s.size() > best_stop->size())) {
      best = at;
      best_stop = &s;
    }
  }
  if (best_stop != nullptr) {
    stopped_ = true;
    out.stopped = true;
    out.matched = *best_stop;
    out.text = held_.substr(0, best + (include_stop_ ? best_stop->size() : 0));
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string. Stop strings are
  // valid UTF-8, so such a suffix starts on a character boundary.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    const size_t max_len = std::min(s.size() - 1, held_.size());
    for (size_t len = max_len; len > keep; --len)
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
  }
  out.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(held_);
  held_.clear();
  return out;
}

}  // namespace moelora::server
