#include "tools/bench_record.h"

#include <cstdio>
#include <ctime>
#include <fstream>

#include "moelora_git_commit.h"  // generated at build time (cmake/GitCommit.cmake)

namespace moelora::tools {

std::string build_commit() { return MOELORA_GIT_COMMIT; }

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
  return buf;
}

bool append_record(const std::string& path, nlohmann::json record, const std::string& gpu) {
  if (path.empty()) return true;
  record["gpu"] = gpu;
  record["date"] = utc_date();
  record["commit"] = build_commit();
  std::ofstream f(path, std::ios::app);
  if (!f) {
    std::fprintf(stderr, "moelora: cannot append to %s\n", path.c_str());
    return false;
  }
  f << record.dump() << "\n";
  return static_cast<bool>(f);
}

}  // namespace moelora::tools
