// moelora serve: the OpenAI-compatible HTTP server (SPEC §5) over one engine. Without --model it
// serves the tiny model that ships in the repository with its two adapters, so that one command
// shows the whole system working.
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"
#include "model/model.h"
#include "runtime/backend_factory.h"
#include "runtime/engine.h"
#include "server/http_server.h"
#include "server/serving_tokenizer.h"
#include "tools/commands.h"
#include "tools/common.h"

namespace moelora::tools {

namespace {

struct ServeArgs {
  std::string model;
  std::vector<std::string> loras;
  std::vector<std::string> pinned;
  BackendOptions backend;
  EngineOptions engine;
  server::ServerOptions server;
  bool allow_runtime_lora = false;
  bool allow_runtime_lora_given = false;
  bool no_prefix_cache = false;
  double shutdown_grace_s = 10.0;
  int heartbeat_ms = 500;
  int tp = 1;  // multi-GPU: not in this build (docs/multi_gpu.md)
  int ep = 1;
};

// "NAME=PATH", or a bare PATH (sglang) named after its folder.
Result<std::pair<std::string, std::string>> parse_lora_spec(const std::string& spec) {
  if (spec.find('=') != std::string::npos) return parse_name_path(spec);
  std::filesystem::path p(spec);
  std::string name = p.filename().string();
  if (name.empty()) name = p.parent_path().filename().string();
  if (name.empty()) return invalid_argument("cannot name the adapter at '{}': use NAME=PATH", spec);
  return std::make_pair(name, spec);
}

void print_usage_hint(const std::string& url, const std::string& model, const std::vector<std::string>& adapters,
                      bool runtime_lora, bool has_chat) {
  const std::string target = adapters.empty() ? model : adapters.front();
  std::printf("\nmoelora is serving '%s'%s%s on %s\n", model.c_str(), adapters.empty() ? "" : " with adapters ",
              fmt::format("{}", fmt::join(adapters, ", ")).c_str(), url.c_str());
  std::printf("Try:\n");
  std::printf("  curl %s/v1/models\n", url.c_str());
  std::printf("  curl %s/v1/completions -H 'Content-Type: application/json' \\\n"
              "    -d '{\"model\": \"%s\", \"prompt\": \"Hello\", \"max_tokens\": 16}'\n",
              url.c_str(), target.c_str());
  if (has_chat)
    std::printf("  curl -N %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
                "\"max_tokens\": 16, \"stream\": true}'\n",
                url.c_str(), target.c_str());
  if (runtime_lora)
    std::printf("  curl %s/v1/load_lora_adapter -H 'Content-Type: application/json' \\\n"
                "    -d '{\"lora_name\": \"NAME\", \"lora_path\": \"/path/to/adapter\"}'\n",
                url.c_str());
  std::printf("Metrics: %s/metrics   Stop: Ctrl-C\n\n", url.c_str());
  std::fflush(stdout);
}

int run_serve(ServeArgs a) {
  const bool bundled = a.model.empty();
  const std::string model_dir = bundled ? default_model_dir() : a.model;
  if (model_dir.empty()) {
    std::fprintf(stderr, "moelora serve: no --model given and the bundled model was not found\n");
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> loras;
  if (bundled) loras = bundled_adapters(model_dir);
  for (const std::string& spec : a.loras) {
    auto np = parse_lora_spec(spec);
    if (!np.ok()) {
      std::fprintf(stderr, "moelora serve: --lora %s\n", np.status().message().c_str());
      return 2;
    }
    loras.push_back(*np);
  }
  if (a.engine.max_loaded_loras < a.engine.max_loras_per_batch) {
    // Every adapter in a slot is also in host memory, so the host cap is at least the slots.
    MOELORA_LOG_WARN("serve: --max-loaded-loras {} is below --max-loras-per-batch {}: using {}",
                     a.engine.max_loaded_loras, a.engine.max_loras_per_batch, a.engine.max_loras_per_batch);
    a.engine.max_loaded_loras = a.engine.max_loras_per_batch;
  }
  a.engine.enable_prefix_cache = !a.no_prefix_cache;

  // Signals are taken by one thread (sigwait), so they never interrupt the engine or the HTTP
  // threads; a peer that closes its socket must not kill the process with SIGPIPE.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto tokenizer = server::ServingTokenizer::load(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "moelora serve: tokenizer: %s\n", tokenizer.status().message().c_str());
    return 1;
  }
  auto backend = make_backend(a.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", backend.status().message().c_str());
    return 2;
  }
  auto model = Model::load(model_dir, **backend);
  if (!model.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", model.status().message().c_str());
    return 1;
  }
  auto engine = Engine::create(std::move(backend).value(), std::move(model).value(), a.engine);
  if (!engine.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", engine.status().message().c_str());
    return 2;
  }
  std::vector<std::string> names;
  for (const auto& [name, path] : loras) {
    const bool pin = std::find(a.pinned.begin(), a.pinned.end(), name) != a.pinned.end();
    Status s = (*engine)->load_adapter(name, path, pin);
    if (!s.ok()) {
      std::fprintf(stderr, "moelora serve: adapter '%s': %s\n", name.c_str(), s.message().c_str());
      return 1;
    }
    names.push_back(name);
  }
  server::ServerOptions so = a.server;
  so.model_path = std::filesystem::absolute(model_dir).lexically_normal().string();
  if (so.served_model_name.empty())
    so.served_model_name = std::filesystem::path(so.model_path).filename().string();
  so.heartbeat = std::chrono::milliseconds(a.heartbeat_ms);
  so.nonstream_probe_after = 2 * so.heartbeat;
  so.allow_runtime_lora = a.allow_runtime_lora_given ? a.allow_runtime_lora : bundled;
  const bool has_chat = (*tokenizer)->has_chat_template();
  server::HttpServer http(**engine, *tokenizer, so);
  auto port = http.bind();
  if (!port.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", port.status().message().c_str());
    return 1;
  }
  const std::string url = fmt::format("http://{}:{}", so.host == "0.0.0.0" ? "127.0.0.1" : so.host, *port);
  MOELORA_LOG_INFO("serve: listening on {} (model '{}', runtime LoRA {})", url, so.served_model_name,
                   so.allow_runtime_lora ? "on" : "off");
  std::printf("listening on %s\n", url.c_str());
  print_usage_hint(url, so.served_model_name, names, so.allow_runtime_lora, has_chat);

  std::atomic<bool> serving_done{false};
  std::thread shutdown_thread;
  std::thread signal_waiter([&] {
    const timespec tick{0, 200 * 1000 * 1000};
    bool shutting_down = false;
    while (!serving_done.load()) {
      const int sig = sigtimedwait(&sigs, nullptr, &tick);
      if (sig != SIGINT && sig != SIGTERM) continue;
      if (shutting_down) {
        // A second Ctrl-C: the user does not want to wait for the grace period.
        MOELORA_LOG_WARN("serve: signal {} again: exiting now", sig);
        std::fflush(nullptr);
        std::_Exit(130);
      }
      shutting_down = true;
      MOELORA_LOG_INFO("serve: signal {}: finishing running requests (up to {} s), then stopping", sig,
                       a.shutdown_grace_s);
      shutdown_thread = std::thread([&] {
        http.shutdown(std::chrono::milliseconds(static_cast<int64_t>(a.shutdown_grace_s * 1000)));
      });
    }
  });
  http.serve();
  serving_done.store(true);
  signal_waiter.join();
  if (shutdown_thread.joinable()) shutdown_thread.join();
  (*engine)->stop();
  MOELORA_LOG_INFO("serve: stopped");
  return 0;
}

}  // namespace

void register_serve(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, adapters, metrics)");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--model", a->model,
                  "model folder (default: the tiny model that ships in the repository, with its two adapters)");
  cmd->add_option("--lora,--lora-modules,--lora-paths", a->loras,
                  "NAME=PATH (or PATH, named after its folder): serve an adapter (repeatable)");
  cmd->add_option("--pin-lora", a->pinned, "NAME: never evict this adapter from host memory (repeatable)");
  cmd->add_option("--host", a->server.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", a->server.port, "port to listen on (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--served-model-name", a->server.served_model_name,
                  "the base model's name in the API (default: the model folder's name)");
  cmd->add_option("--backend", a->backend.name, "cpu or cuda")->capture_default_str();
  cmd->add_flag("!--no-graphs", a->backend.cuda_graphs, "CUDA: run decode steps eagerly instead of replaying graphs");
  cmd->add_flag("!--no-overlap", a->backend.cuda_overlap, "CUDA: run MoE LoRA on the main stream, not a side stream");
  cmd->add_option("--max-loras-per-batch,--max-loras", a->engine.max_loras_per_batch,
                  "adapter slots: distinct adapters in one batch")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--max-loaded-loras,--max-cpu-loras", a->engine.max_loaded_loras,
                  "adapters kept in host memory (least recently used beyond that are dropped and re-read on use)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--max-lora-rank", a->engine.max_lora_rank, "largest adapter rank accepted")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-num-seqs", a->engine.max_num_seqs, "requests running at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--max-batch-tokens,--max-num-batched-tokens", a->engine.max_batch_tokens,
                  "tokens per engine step (longer prompts are prefilled in chunks)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--max-model-len", a->engine.max_model_len, "context length (0: the model's)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--kv-cache-pages", a->engine.kv_num_pages, "KV cache pages (0: enough for --max-num-seqs full contexts)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 26));
  cmd->add_option("--kv-page-size", a->engine.kv_page_size, "positions per KV page")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_flag("--no-prefix-cache", a->no_prefix_cache, "do not reuse the KV of common prompt prefixes");
  cmd->add_option("--max-queued-requests", a->engine.max_waiting, "waiting requests beyond which new ones get 429")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--lora-root", a->engine.lora_root,
                  "adapter paths (startup and /v1/load_lora_adapter) must resolve inside this folder");
  CLI::Option* runtime_lora =
      cmd->add_flag("--allow-runtime-lora,!--no-runtime-lora", a->allow_runtime_lora,
                    "enable /v1/load_lora_adapter and /v1/unload_lora_adapter (default: on only for the bundled model)");
  cmd->add_option("--http-threads", a->server.http_threads,
                  "HTTP connections served at once (each open stream holds one)")
      ->capture_default_str()
      ->check(CLI::Range(17, 100000));
  cmd->add_option("--max-request-bytes", a->server.max_request_bytes, "larger request bodies get 413")
      ->capture_default_str();
  cmd->add_option("--heartbeat-ms", a->heartbeat_ms,
                  "how often an idle response is probed with a keep-alive write (an SSE comment, or whitespace before "
                  "a slow non-streamed body), so that a client that went away is noticed and its request cancelled")
      ->capture_default_str()
      ->check(CLI::Range(10, 60000));
  cmd->add_option("--shutdown-grace", a->shutdown_grace_s,
                  "seconds running requests get to finish after SIGINT/SIGTERM")
      ->capture_default_str();
  cmd->add_option("--tp", a->tp, "tensor-parallel GPUs (one process each; needs an NCCL build, docs/multi_gpu.md)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--ep", a->ep, "expert-parallel GPUs: tp x ep processes in all (needs an NCCL build)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->callback([a, runtime_lora, &exit_code] {
    if (a->tp * a->ep > 1) {
      std::fprintf(stderr,
                   "moelora serve: --tp %d --ep %d needs %d GPUs, one process each joined by NCCL; this build has no "
                   "NCCL launcher yet (docs/multi_gpu.md). `moelora verify --backend cpu --tp/--ep` checks the sharding\n",
                   a->tp, a->ep, a->tp * a->ep);
      exit_code = 2;
      return;
    }
    a->allow_runtime_lora_given = runtime_lora->count() > 0;
    exit_code = run_serve(*a);
  });
}

}  // namespace moelora::tools
