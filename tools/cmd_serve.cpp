// moelora serve: the OpenAI-compatible HTTP server (docs/serving.md) over one engine. Without --model it
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
#include "io/mapped_file.h"
#include "lora/random_adapter.h"
#include "model/archs.h"
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
  double request_timeout_s = 30.0;
  double keep_alive_timeout_s = 5.0;
  double stats_interval_s = 10.0;
  // Full-size serving benchmarks: a model of --config's shapes with random weights (as `bench`
  // makes them) and adapters made in memory, no checkpoint or adapter files needed.
  std::string config;
  bool random_weights = false;
  int random_adapters = 0;
  int random_adapter_rank = 16;
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
  if (a.random_weights && a.config.empty()) {
    std::fprintf(stderr, "moelora serve: --random-weights needs --config CONFIG.json (the shapes)\n");
    return 2;
  }
  if (!a.random_weights && (a.random_adapters > 0 || !a.config.empty())) {
    std::fprintf(stderr, "moelora serve: --config and --random-adapters go with --random-weights\n");
    return 2;
  }
  const bool bundled = a.model.empty() && !a.random_weights;
  // With random weights the config's folder is the model folder (a tokenizer.json there is used;
  // without one, prompts are token ids).
  const std::string model_dir = a.random_weights ? std::filesystem::path(a.config).parent_path().string()
                                : bundled       ? default_model_dir()
                                                : a.model;
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

  // The port is bound before the model loads: a bad --port fails at once, and orchestrators see
  // the server come up (/health: 503 "loading", then 200) instead of a refused connection.
  server::ServerOptions so = a.server;
  so.model_path = std::filesystem::absolute(model_dir).lexically_normal().string();
  if (so.served_model_name.empty())
    so.served_model_name = a.random_weights ? std::filesystem::path(a.config).stem().string()
                                            : std::filesystem::path(so.model_path).filename().string();
  so.heartbeat = std::chrono::milliseconds(a.heartbeat_ms);
  so.request_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.request_timeout_s * 1000));
  so.keep_alive_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.keep_alive_timeout_s * 1000));
  so.stats_interval = std::chrono::milliseconds(static_cast<int64_t>(a.stats_interval_s * 1000));
  so.max_loras = a.engine.max_loras_per_batch;
  so.worker_threads = std::max(2, so.http_threads);
  if (!a.engine.lora_root.empty())
    so.lora_root = std::filesystem::absolute(a.engine.lora_root).lexically_normal().string();
  // Runtime loading reads files a client names: only inside --lora-root, never anywhere.
  if (a.allow_runtime_lora_given && a.allow_runtime_lora && so.lora_root.empty()) {
    std::fprintf(stderr, "moelora serve: --allow-runtime-lora needs --lora-root DIR (adapters are loaded from inside DIR "
                         "only)\n");
    return 2;
  }
  so.allow_runtime_lora = a.allow_runtime_lora_given ? a.allow_runtime_lora : !so.lora_root.empty();
  if (so.api_keys.empty())
    if (const char* key = std::getenv("MOELORA_API_KEY"); key != nullptr && *key != '\0') so.api_keys.push_back(key);
  if (!server::is_loopback_host(so.host) && so.api_keys.empty())
    MOELORA_LOG_WARN("serve: listening on {} without --api-key: anyone who can reach this address can generate{}",
                     so.host, so.allow_runtime_lora ? " and load adapters from --lora-root" : "");
  auto http = std::make_unique<server::HttpServer>(so);
  auto port = http->start();
  if (!port.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", port.status().message().c_str());
    return 1;
  }
  const std::string url = fmt::format("http://{}:{}", so.host == "0.0.0.0" ? "127.0.0.1" : so.host, *port);
  std::printf("listening on %s (loading the model; /health answers 503 until it is ready)\n", url.c_str());
  std::fflush(stdout);
  // Signals are handled from here on, also while the model loads.
  std::atomic<bool> serving_done{false};
  std::atomic<bool> attached{false};
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
      if (!attached.load()) {
        // Loading cannot be interrupted half-way; nothing is being served yet, so just exit.
        MOELORA_LOG_WARN("serve: signal {} while loading: exiting", sig);
        std::fflush(nullptr);
        std::_Exit(128 + sig);
      }
      shutting_down = true;
      MOELORA_LOG_INFO("serve: signal {}: finishing running requests (up to {} s), then stopping", sig,
                       a.shutdown_grace_s);
      shutdown_thread = std::thread([&] {
        http->shutdown(std::chrono::milliseconds(static_cast<int64_t>(a.shutdown_grace_s * 1000)));
      });
    }
  });
  struct JoinOnExit {  // every return below (a failed load too) must end the signal thread
    std::atomic<bool>& done;
    std::thread& waiter;
    std::thread& shutdown;
    ~JoinOnExit() {
      done.store(true);
      if (waiter.joinable()) waiter.join();
      if (shutdown.joinable()) shutdown.join();
    }
  } join_on_exit{serving_done, signal_waiter, shutdown_thread};
  const auto load_start = std::chrono::steady_clock::now();
  auto since_start = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(); };

  MOELORA_LOG_INFO("serve: loading the tokenizer from {}", model_dir);
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
  Result<std::unique_ptr<Model>> model = make_error(ErrorCode::kInternal, "no model");
  ModelConfig random_cfg;
  if (a.random_weights) {
    auto text = read_text_file(a.config);
    if (!text.ok()) {
      std::fprintf(stderr, "moelora serve: %s\n", text.status().message().c_str());
      return 2;
    }
    auto cfg = parse_model_config(*text, a.config);
    if (!cfg.ok()) {
      std::fprintf(stderr, "moelora serve: %s\n", cfg.status().message().c_str());
      return 2;
    }
    random_cfg = *cfg;
    MOELORA_LOG_INFO("serve: random weights of {} shapes ({} layers)", arch_name(random_cfg.arch), random_cfg.num_layers);
    model = Model::random(random_cfg, **backend, 7);
  } else {
    uintmax_t weight_bytes = 0;
    int weight_files = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(model_dir, ec))
      if (e.path().extension() == ".safetensors") {
        weight_bytes += e.file_size(ec);
        ++weight_files;
      }
    MOELORA_LOG_INFO("serve: loading weights from {} ({} safetensors file(s), {:.2f} GiB) on {}", model_dir,
                     weight_files, static_cast<double>(weight_bytes) / (1ull << 30), a.backend.name);
    model = Model::load(model_dir, **backend);
  }
  if (!model.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", model.status().message().c_str());
    return 1;
  }
  MOELORA_LOG_INFO("serve: weights loaded in {:.1f} s; starting the engine", since_start());
  auto engine = Engine::create(std::move(backend).value(), std::move(model).value(), a.engine);
  if (!engine.ok()) {
    std::fprintf(stderr, "moelora serve: %s\n", engine.status().message().c_str());
    return 2;
  }
  std::vector<std::string> names;
  for (int i = 0; i < a.random_adapters; ++i) {
    const std::string name = fmt::format("random-{}", i);
    Status s = (*engine)->add_adapter(name, make_random_adapter(random_cfg, name, a.random_adapter_rank, 100 + i));
    if (!s.ok()) {
      std::fprintf(stderr, "moelora serve: adapter '%s': %s\n", name.c_str(), s.message().c_str());
      return 1;
    }
    names.push_back(name);
  }
  for (size_t i = 0; i < loras.size(); ++i) {
    const auto& [name, path] = loras[i];
    const bool pin = std::find(a.pinned.begin(), a.pinned.end(), name) != a.pinned.end();
    MOELORA_LOG_INFO("serve: loading adapter {}/{} '{}' from {}", i + 1, loras.size(), name, path);
    // The operator's own adapters (command line, bundled) may live anywhere; --lora-root
    // confines what clients load at runtime.
    AdapterLoadSpec spec;
    spec.pinned = pin;
    Status s = (*engine)->load_adapter(name, path, spec);
    if (!s.ok()) {
      std::fprintf(stderr, "moelora serve: adapter '%s': %s\n", name.c_str(), s.message().c_str());
      return 1;
    }
    names.push_back(name);
  }
  const bool has_chat = (*tokenizer)->has_chat_template();
  http->attach(**engine, *tokenizer);
  attached.store(true);
  const EngineStats ready_stats = (*engine)->stats();
  MOELORA_LOG_INFO("serve: ready in {:.1f} s: model '{}' ({}), {} adapter(s), {} KV pages of {} positions, max model "
                   "length {}, runtime LoRA {}, API key {}",
                   since_start(), so.served_model_name, a.backend.name, names.size(), ready_stats.kv_pages_total,
                   a.engine.kv_page_size, (*engine)->max_model_len(),
                   so.allow_runtime_lora ? "on (inside " + so.lora_root + ")" : std::string("off"),
                   so.api_keys.empty() ? "none" : "required");
  std::printf("ready on %s\n", url.c_str());
  print_usage_hint(url, so.served_model_name, names, so.allow_runtime_lora, has_chat);

  http->wait();
  serving_done.store(true);
  signal_waiter.join();
  if (shutdown_thread.joinable()) shutdown_thread.join();
  http.reset();  // before the engine: pending responses cancel their requests in it
  (*engine)->stop();
  MOELORA_LOG_INFO("serve: stopped");
  return 0;
}

}  // namespace

void register_serve(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, adapters, metrics)");
  auto a = std::make_shared<ServeArgs>();
  cmd->add_option("--config", a->config, "with --random-weights: the config.json whose shapes to serve");
  cmd->add_flag("--random-weights", a->random_weights,
                "serve a model of --config's shapes with random weights (full-size benchmarks; no checkpoint)");
  cmd->add_option("--random-adapters", a->random_adapters,
                  "with --random-weights: this many adapters (random-0, random-1, ...) made in memory")
      ->capture_default_str();
  cmd->add_option("--random-adapter-rank", a->random_adapter_rank, "rank of the random adapters, on every target")
      ->capture_default_str();
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
  add_cuda_backend_flags(cmd, a->backend);
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
  cmd->add_option("--gpu-memory-utilization", a->engine.gpu_memory_utilization,
                  "CUDA: fraction of the GPU's memory the server may hold; the KV cache gets what weights, step "
                  "scratch and adapter slots leave of it")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--kv-cache-pages", a->engine.kv_num_pages,
                  "KV cache pages (0: CUDA sizes it by --gpu-memory-utilization; CPU: enough for --max-num-seqs full "
                  "contexts up to 4 GiB)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 26));
  cmd->add_option("--kv-page-size", a->engine.kv_page_size, "positions per KV page")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_flag("--no-prefix-cache", a->no_prefix_cache, "do not reuse the KV of common prompt prefixes");
  cmd->add_option("--penalty-slots", a->engine.penalty_slots,
                  "sequences whose repetition/frequency/presence counts stay on the backend (4 bytes per vocabulary "
                  "token each; -1: min(--max-num-seqs, 256); 0: every penalised request sends its counts each step)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 65536));
  cmd->add_option("--max-queued-requests", a->engine.max_waiting, "waiting requests beyond which new ones get 429")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--lora-root", a->engine.lora_root,
                  "turns on /v1/load_lora_adapter: every file of an adapter loaded at runtime must resolve inside this "
                  "folder (checked at load and every re-read)");
  CLI::Option* runtime_lora =
      cmd->add_flag("--allow-runtime-lora,!--no-runtime-lora", a->allow_runtime_lora,
                    "enable /v1/load_lora_adapter and /v1/unload_lora_adapter (default: on when --lora-root is given; "
                    "needs it)");
  cmd->add_option("--api-key", a->server.api_keys,
                  "require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize (repeatable; also "
                  "the MOELORA_API_KEY environment variable)");
  cmd->add_option("--allowed-host", a->server.allowed_hosts,
                  "Host header values answered (repeatable; '*' = any). Default: loopback names when listening on "
                  "loopback, any otherwise");
  cmd->add_option("--http-threads", a->server.http_threads, "I/O threads of the HTTP server (and handler threads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--max-connections", a->server.max_connections,
                  "open connections at most; more are answered 503 and closed")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-open-requests", a->server.max_open_requests,
                  "generation responses open at once, streams included; more get 503")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-request-bytes", a->server.max_request_bytes,
                  "larger request bodies get 413 (chunked bodies are counted as they arrive; compressed bodies are refused)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 34));
  cmd->add_option("--max-header-bytes", a->server.max_header_bytes, "request line and headers beyond this get 431")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1024}, size_t{1} << 24));
  cmd->add_option("--max-header-count", a->server.max_header_count, "header fields beyond this get 431")
      ->capture_default_str()
      ->check(CLI::Range(8, 10000));
  cmd->add_option("--max-choices-per-request", a->server.limits.max_choices,
                  "prompts x n of one request (the engine sequences it holds) at most")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--request-timeout", a->request_timeout_s,
                  "seconds a whole request (headers and body) may take to arrive; 408 beyond")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--keep-alive-timeout", a->keep_alive_timeout_s, "seconds an idle connection is kept between requests")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--heartbeat-ms", a->heartbeat_ms,
                  "how often an idle SSE stream gets a comment line (keeps proxies from timing it out)")
      ->capture_default_str()
      ->check(CLI::Range(10, 60000));
  cmd->add_option("--stats-interval", a->stats_interval_s,
                  "seconds between throughput log lines while the server is busy (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
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
