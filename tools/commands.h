// Subcommands of the `moelora` executable. Each lives in its own cmd_<name>.cpp and registers
// itself on the CLI11 app; the callback it sets runs the command and returns its exit code
// through `exit_code`.
#pragma once

#include <CLI/CLI.hpp>

namespace moelora::tools {

void register_verify(CLI::App& app, int& exit_code);
void register_generate(CLI::App& app, int& exit_code);
void register_tokenize(CLI::App& app, int& exit_code);
void register_serve(CLI::App& app, int& exit_code);
void register_bench(CLI::App& app, int& exit_code);
void register_bench_serving(CLI::App& app, int& exit_code);

// Where the model that ships in the repository lives (with its adapters), found next to the
// executable or in the source tree; empty if not found.
std::string default_model_dir();

}  // namespace moelora::tools
