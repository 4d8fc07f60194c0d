// Machine-readable benchmark records: one JSON object per measured point, appended as a line to
// the file given with --json (bench/records/ keeps the H200 ones). Every record carries what the
// figure needs to be read later: the GPU, the date and the commit it was measured on.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace moelora::tools {

// The commit this binary was built from (configure time; "-dirty" when the tree had changes).
std::string build_commit();
// Today's date, UTC, as YYYY-MM-DD.
std::string utc_date();
// Adds "gpu", "date" and "commit" to `record` and appends it as one line to `path` (no-op when
// `path` is empty). Returns false with a message on stderr when the file cannot be written.
bool append_record(const std::string& path, nlohmann::json record, const std::string& gpu);

}  // namespace moelora::tools
