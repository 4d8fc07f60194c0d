#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace moelora {

void set_log_level(const std::string& level) {
  static bool once = [] {
    spdlog::set_default_logger(spdlog::stderr_color_mt("moelora"));
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
    return true;
  }();
  (void)once;
  spdlog::set_level(spdlog::level::from_str(level));
}

}  // namespace moelora
