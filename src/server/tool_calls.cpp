#include "server/tool_calls.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>

namespace moelora::server {
namespace {

constexpr std::string_view kHermesBegin = "<tool_call>";
constexpr std::string_view kHermesEnd = "</tool_call>";
constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kDsCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kDsCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kDsSep = "<｜tool▁sep｜>";
constexpr std::string_view kMistralBegin = "[TOOL_CALLS]";

std::string_view start_marker(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes: return kHermesBegin;
    case ToolCallFormat::kDeepSeekV3: return kDsCallsBegin;
    case ToolCallFormat::kMistral: return kMistralBegin;
    case ToolCallFormat::kNone: break;
  }
  return {};
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
  return pos;
}

std::string_view trim(std::string_view s) {
  size_t b = skip_space(s, 0), e = s.size();
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// The end of the JSON object starting at s[pos] == '{' (one past its '}'), string escapes
// respected; npos while it is not closed yet.
size_t object_end(std::string_view s, size_t pos) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = pos; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

// arguments as OpenAI sends them: a JSON text. An object is written compactly; a string that
// already holds JSON is kept as written.
std::optional<std::string> arguments_text(const Json& args) {
  if (args.is_object()) return args.dump();
  if (args.is_string()) {
    auto parsed = Json::parse(args.get<std::string>(), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) return args.get<std::string>();
  }
  return std::nullopt;
}

// {"name": ..., "arguments": {...}} (Qwen2.5 sometimes says "parameters").
std::optional<ToolCall> call_from_object(std::string_view text, ToolCallFormat f) {
  auto j = Json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return std::nullopt;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  ToolCall call;
  call.name = name->get<std::string>();
  if (args == j.end() || args->is_null()) {
    call.arguments = "{}";
  } else {
    auto a = arguments_text(*args);
    if (!a) return std::nullopt;
    call.arguments = *a;
  }
  call.id = make_tool_call_id(f);
  return call;
}

struct Scan {
  std::vector<ToolCall> calls;
  size_t end = 0;  // where the text after the last complete call (or closer) starts
};

enum class Next { kCall, kNeedMore, kDone, kMalformed };

// One call of `r` (the text from the start marker on) at `pos`; `opened` says whether the
// format's opening (the marker, Mistral's '[') is behind us.
Next next_call(ToolCallFormat f, std::string_view r, size_t& pos, bool& opened, ToolCall* out) {
  const auto starts = [&](size_t at, std::string_view lit) { return r.substr(at, lit.size()) == lit; };
  // True when r[at..] is a proper prefix of `lit`: more text may complete it.
  const auto partial = [&](size_t at, std::string_view lit) { return r.size() - at < lit.size() && lit.starts_with(r.substr(at)); };
  size_t p = skip_space(r, pos);
  switch (f) {
    case ToolCallFormat::kHermes: {
      if (p == r.size()) return Next::kNeedMore;
      if (!starts(p, kHermesBegin)) return partial(p, kHermesBegin) ? Next::kNeedMore : Next::kDone;
      const size_t body = p + kHermesBegin.size();
      const size_t close = r.find(kHermesEnd, body);
      if (close == std::string_view::npos) return Next::kNeedMore;
      auto call = call_from_object(trim(r.substr(body, close - body)), f);
      if (!call) return Next::kMalformed;
      *out = std::move(*call);
      pos = close + kHermesEnd.size();
      return Next::kCall;
    }
    case ToolCallFormat::kDeepSeekV3: {
      if (!opened) {
        if (!starts(p, kDsCallsBegin)) return Next::kMalformed;
        p = skip_space(r, p + kDsCallsBegin.size());
        opened = true;
        pos = p;
      }
      if (p == r.size()) return Next::kNeedMore;
      if (starts(p, kDsCallsEnd)) {
        pos = p + kDsCallsEnd.size();
        return Next::kDone;
      }
      if (!starts(p, kDsCallBegin)) {
        return partial(p, kDsCallBegin) || partial(p, kDsCallsEnd) ? Next::kNeedMore : Next::kMalformed;
      }
      const size_t body = p + kDsCallBegin.size();
      const size_t close = r.find(kDsCallEnd, body);
      if (close == std::string_view::npos) return Next::kNeedMore;
      // function<｜tool▁sep｜>NAME\n```json\nARGS\n```
      std::string_view b = r.substr(body, close - body);
      const size_t sep = b.find(kDsSep);
      if (sep == std::string_view::npos) return Next::kMalformed;
      std::string_view rest = b.substr(sep + kDsSep.size());
      const size_t nl = rest.find('\n');
      if (nl == std::string_view::npos) return Next::kMalformed;
      const std::string_view name = trim(rest.substr(0, nl));
      std::string_view args = trim(rest.substr(nl + 1));
      if (args.starts_with("```")) {
        const size_t line = args.find('\n');
        const size_t fence = args.rfind("```");
        if (line == std::string_view::npos || fence <= line) return Next::kMalformed;
        args = trim(args.substr(line + 1, fence - line - 1));
      }
      auto parsed = Json::parse(args, nullptr, false);
      if (name.empty() || parsed.is_discarded() || !parsed.is_object()) return Next::kMalformed;
      out->id = make_tool_call_id(f);
      out->name = std::string(name);
      out->arguments = parsed.dump();
      pos = close + kDsCallEnd.size();
      return Next::kCall;
    }
    case ToolCallFormat::kMistral: {
      if (!opened) {
        if (!starts(p, kMistralBegin)) return Next::kMalformed;
        p = skip_space(r, p + kMistralBegin.size());
        if (p == r.size()) return Next::kNeedMore;
        if (r[p] != '[') return Next::kMalformed;
        ++p;
        opened = true;
        pos = p;  // the opening is consumed even if no call completes
      }
      p = skip_space(r, p);
      if (p < r.size() && r[p] == ',') p = skip_space(r, p + 1);
      if (p == r.size()) return Next::kNeedMore;
      if (r[p] == ']') {
        pos = p + 1;
        return Next::kDone;
      }
      if (r[p] != '{') return Next::kMalformed;
      const size_t end = object_end(r, p);
      if (end == std::string_view::npos) return Next::kNeedMore;
      auto call = call_from_object(r.substr(p, end - p), f);
      if (!call) return Next::kMalformed;
      *out = std::move(*call);
      pos = end;
      return Next::kCall;
    }
    case ToolCallFormat::kNone:
      break;
  }
  return Next::kMalformed;
}

// Every complete call of `region`, in order, up to the first thing that is not one.
Scan scan_calls(ToolCallFormat f, std::string_view region) {
  Scan s;
  size_t pos = 0;
  bool opened = false;
  for (;;) {
    ToolCall call;
    const Next n = next_call(f, region, pos, opened, &call);
    if (n == Next::kCall) {
      s.calls.push_back(std::move(call));
      s.end = pos;
      continue;
    }
    if (n == Next::kDone) s.end = std::max(s.end, pos);
    break;
  }
  return s;
}

}  // namespace

const char* tool_call_format_name(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes: return "hermes";
    case ToolCallFormat::kDeepSeekV3: return "deepseek_v3";
    case ToolCallFormat::kMistral: return "mistral";
    case ToolCallFormat::kNone: break;
  }
  return "none";
}

ToolCallFormat detect_tool_call_format(const std::function<bool(std::string_view)>& has_token,
                                       const std::function<bool(std::string_view)>& template_mentions) {
  if (has_token(kDsCallsBegin)) return ToolCallFormat::kDeepSeekV3;
  if (has_token(kMistralBegin)) return ToolCallFormat::kMistral;
  if (has_token(kHermesBegin)) return ToolCallFormat::kHermes;
  if (template_mentions(kDsCallsBegin)) return ToolCallFormat::kDeepSeekV3;
  if (template_mentions(kMistralBegin)) return ToolCallFormat::kMistral;
  if (template_mentions(kHermesBegin)) return ToolCallFormat::kHermes;
  return ToolCallFormat::kNone;
}

bool tool_markers_are_special(ToolCallFormat f) {
  // Qwen's <tool_call> is an added token that is not special; DeepSeek's and Mistral's markers are.
  return f == ToolCallFormat::kDeepSeekV3 || f == ToolCallFormat::kMistral;
}

std::string make_tool_call_id(ToolCallFormat format) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  if (format == ToolCallFormat::kMistral) {
    static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::string id(9, 'a');
    for (char& c : id) c = kAlnum[rng() % (sizeof(kAlnum) - 1)];
    return id;
  }
  return fmt::format("call_{:016x}{:08x}", rng(), static_cast<uint32_t>(rng()));
}

ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view text) {
  ParsedToolCalls out;
  const std::string_view marker = start_marker(format);
  const size_t at = marker.empty() ? std::string_view::npos : text.find(marker);
  if (at == std::string_view::npos) {
    out.content = std::string(text);
    return out;
  }
  Scan s = scan_calls(format, text.substr(at));
  if (s.calls.empty()) {
    out.content = std::string(text);
    return out;
  }
  out.calls = std::move(s.calls);
  out.content = std::string(text.substr(0, at));
  // What follows the calls, if it is more than whitespace, is not lost.
  const std::string_view rest = trim(text.substr(at + s.end));
  if (!rest.empty()) out.content += std::string(rest);
  return out;
}

OJson tool_calls_json(const std::vector<ToolCall>& calls) {
  OJson arr = OJson::array();
  for (const ToolCall& c : calls) {
    arr.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  }
  return arr;
}

ToolCallStreamParser::Delta ToolCallStreamParser::feed(std::string_view text) {
  Delta d;
  if (format_ == ToolCallFormat::kNone) {
    d.content = std::string(text);
    return d;
  }
  if (in_calls_) {
    calls_.append(text);
    emit_calls(d, /*at_end=*/false);
    return d;
  }
  held_.append(text);
  const std::string_view marker = start_marker(format_);
  const size_t at = held_.find(marker);
  if (at != std::string::npos) {
    d.content = held_.substr(0, at);
    calls_ = held_.substr(at);
    held_.clear();
    in_calls_ = true;
    emit_calls(d, false);
    return d;
  }
  // Hold back the longest end of the text that could still become the marker.
  size_t keep = std::min(held_.size(), marker.size() - 1);
  while (keep > 0 && !marker.starts_with(std::string_view(held_).substr(held_.size() - keep))) --keep;
  d.content = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return d;
}

void ToolCallStreamParser::emit_calls(Delta& d, bool at_end) {
  // Re-scanning the whole call text keeps the stream and parse_tool_calls() identical; call
  // text is short (bounded by max_tokens).
  Scan s = scan_calls(format_, calls_);
  for (size_t i = static_cast<size_t>(next_index_); i < s.calls.size(); ++i) {
    const ToolCall& c = s.calls[i];
    d.tool_calls.push_back({{"index", next_index_},
                            {"id", c.id},
                            {"type", "function"},
                            {"function", {{"name", c.name}, {"arguments", ""}}}});
    d.tool_calls.push_back({{"index", next_index_}, {"function", {{"arguments", c.arguments}}}});
    ++next_index_;
  }
  if (!at_end) return;
  if (next_index_ == 0) {
    d.content += calls_;  // nothing parsed: the marker and all after it are plain text
  } else {
    const std::string_view rest = trim(std::string_view(calls_).substr(s.end));
    d.content += std::string(rest);
  }
  consumed_ = calls_.size();
}

ToolCallStreamParser::Delta ToolCallStreamParser::finish() {
  Delta d;
  if (!in_calls_) {
    d.content = std::move(held_);
    held_.clear();
    return d;
  }
  if (consumed_ == 0) emit_calls(d, /*at_end=*/true);  // calls_ holds at least the marker
  return d;
}

}  // namespace moelora::server
