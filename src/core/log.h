// Logging through spdlog (stderr). One call site per line of output; no global state besides
// spdlog's default logger.
#pragma once

#include <spdlog/spdlog.h>

namespace moelora {

// Sets the level from a name (trace, debug, info, warn, error, off); unknown names keep info.
void set_log_level(const std::string& level);

}  // namespace moelora

#define MOELORA_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define MOELORA_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define MOELORA_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
#define MOELORA_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
