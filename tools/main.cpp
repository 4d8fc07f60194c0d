// moelora: serve Mixture-of-Experts models with many LoRA adapters in the same batch.
#include <cstdio>

#include "core/log.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"moelora: MoE models with many LoRA adapters in one batch"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")->capture_default_str();
  // Global options are accepted after the subcommand too (`moelora serve --log-level debug`):
  // subcommands inherit fallthrough and hand options they do not know to the main command.
  app.fallthrough();
  int exit_code = 0;
  moelora::tools::register_verify(app, exit_code);
  moelora::tools::register_generate(app, exit_code);
  moelora::tools::register_tokenize(app, exit_code);
  moelora::tools::register_serve(app, exit_code);
  moelora::tools::register_bench(app, exit_code);
  moelora::tools::register_bench_serving(app, exit_code);
  app.parse_complete_callback([&] { moelora::set_log_level(log_level); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
