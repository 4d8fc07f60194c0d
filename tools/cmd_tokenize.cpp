// Placeholder: replaced when this subcommand lands.
#include <cstdio>

#include "tools/commands.h"

namespace moelora::tools {

void register_tokenize(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("tokenize", "(not built yet)");
  cmd->callback([&exit_code] {
    std::fprintf(stderr, "moelora: this subcommand is not built yet\n");
    exit_code = 2;
  });
}

}  // namespace moelora::tools
