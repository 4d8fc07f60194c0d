// Helpers shared by the subcommands.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "runtime/backend_factory.h"

namespace CLI {
class App;
}

namespace moelora::tools {

// The CUDA backend's flags, the same in every subcommand that builds a backend:
// --no-graphs, --no-overlap, --moe-fp8-activations.
void add_cuda_backend_flags(CLI::App* cmd, BackendOptions& o);

// "name=path" -> (name, path).
Result<std::pair<std::string, std::string>> parse_name_path(const std::string& spec);
// "1,2,3" or "1 2 3" -> ids.
Result<std::vector<int32_t>> parse_ids(const std::string& text);
// The adapters that ship with a model folder (<dir>/adapters/<name>), sorted by name.
std::vector<std::pair<std::string, std::string>> bundled_adapters(const std::string& model_dir);

}  // namespace moelora::tools
