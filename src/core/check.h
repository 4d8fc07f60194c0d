// Error handling, tier two: a broken invariant is a bug in moelora, not bad input. It aborts with
// file:line so that it is found, instead of producing wrong tokens.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace moelora::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace moelora::detail

#define MOELORA_CHECK(cond)                                                  \
  do {                                                                       \
    if (!(cond)) ::moelora::detail::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)

#define MOELORA_CHECK_MSG(cond, ...)                                         \
  do {                                                                       \
    if (!(cond))                                                             \
      ::moelora::detail::check_failed(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
  } while (0)
