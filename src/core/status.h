// Error handling, tier one: bad input (a request, an adapter, a checkpoint) becomes a Status that
// travels up to the API boundary as a clear message; the process keeps serving.
// Tier two (broken invariants) is MOELORA_CHECK in check.h, which aborts with file:line.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace moelora {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,   // malformed input: a request field, a config value, a tensor shape
  kNotFound,          // a file, adapter or model name that does not exist
  kUnsupported,       // well-formed but outside what moelora serves (DoRA, an unknown arch...)
  kAlreadyExists,     // e.g. an adapter name that is already loaded
  kResourceExhausted, // queue full, no slot, no KV pages
  kFailedPrecondition,// e.g. unloading an adapter that is pinned
  kCancelled,
  kInternal,
};

const char* error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

  // Prefixes context ("while loading adapter 'sql': ") to an error; no-op when ok.
  Status with_context(const std::string& context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return {ErrorCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> f, Args&&... args) {
  return {ErrorCode::kNotFound, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status unsupported(fmt::format_string<Args...> f, Args&&... args) {
  return {ErrorCode::kUnsupported, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status make_error(ErrorCode code, fmt::format_string<Args...> f, Args&&... args) {
  return {code, fmt::format(f, std::forward<Args>(args)...)};
}

// A value or an error (C++23's std::expected is not available with g++ 12).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}            // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}      // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace moelora

#define MOELORA_CONCAT_INNER(a, b) a##b
#define MOELORA_CONCAT(a, b) MOELORA_CONCAT_INNER(a, b)

// Returns the error of a Status-returning expression.
#define MOELORA_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::moelora::Status _moelora_st = (expr);        \
    if (!_moelora_st.ok()) return _moelora_st;     \
  } while (0)

// `MOELORA_ASSIGN_OR_RETURN(auto x, make_x());` declares x or returns the error.
#define MOELORA_ASSIGN_OR_RETURN(lhs, expr) \
  MOELORA_ASSIGN_OR_RETURN_IMPL(MOELORA_CONCAT(_moelora_res_, __COUNTER__), lhs, expr)
#define MOELORA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
