// moelora generate: runs prompts through the engine, each under the base model and under every
// adapter asked for, all in one batch, and prints the generated ids (and text when the model has
// a tokenizer).
#include <cstdio>
#include <mutex>
#include <condition_variable>

#include <fmt/format.h>

#include "model/model.h"
#include "runtime/backend_factory.h"
#include "runtime/engine.h"
#include "tools/commands.h"
#include "tools/common.h"
#include "tools/text_io.h"

namespace moelora::tools {

namespace {

struct Args {
  std::string model;
  std::vector<std::string> loras;
  std::vector<std::string> prompts;
  std::vector<std::string> prompt_ids;
  std::vector<std::string> adapters;  // which to run ("" = base); empty = base + all loaded
  BackendOptions backend;
  SamplingParams sampling;
  bool no_base = false;
};

int run(const Args& a) {
  const std::string model_dir = a.model.empty() ? default_model_dir() : a.model;
  if (model_dir.empty()) {
    std::fprintf(stderr, "moelora generate: no --model given and the bundled model was not found\n");
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> loras;
  if (a.model.empty()) loras = bundled_adapters(model_dir);
  for (const std::string& spec : a.loras) {
    auto np = parse_name_path(spec);
    if (!np.ok()) {
      std::fprintf(stderr, "moelora generate: --lora %s\n", np.status().message().c_str());
      return 2;
    }
    loras.push_back(*np);
  }
  auto backend = make_backend(a.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "moelora generate: %s\n", backend.status().message().c_str());
    return 2;
  }
  auto model = Model::load(model_dir, **backend);
  if (!model.ok()) {
    std::fprintf(stderr, "moelora generate: %s\n", model.status().message().c_str());
    return 1;
  }
  TextCodec codec(model_dir);
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : a.prompt_ids) {
    auto ids = parse_ids(p);
    if (!ids.ok()) {
      std::fprintf(stderr, "moelora generate: %s\n", ids.status().message().c_str());
      return 2;
    }
    prompts.push_back(*ids);
  }
  for (const std::string& p : a.prompts) {
    auto ids = codec.encode(p);
    if (!ids.ok()) {
      std::fprintf(stderr, "moelora generate: %s\n", ids.status().message().c_str());
      return 2;
    }
    prompts.push_back(*ids);
  }
  if (prompts.empty()) {
    std::fprintf(stderr, "moelora generate: give --prompt TEXT or --prompt-ids IDS\n");
    return 2;
  }
  EngineOptions opts;
  opts.max_loras_per_batch = std::max<int>(1, static_cast<int>(loras.size()));
  opts.max_loaded_loras = std::max(opts.max_loras_per_batch, 32);
  auto engine = Engine::create(std::move(backend).value(), std::move(model).value(), opts);
  if (!engine.ok()) {
    std::fprintf(stderr, "moelora generate: %s\n", engine.status().message().c_str());
    return 1;
  }
  for (const auto& [name, path] : loras) {
    Status s = (*engine)->load_adapter(name, path);
    if (!s.ok()) {
      std::fprintf(stderr, "moelora generate: adapter '%s': %s\n", name.c_str(), s.message().c_str());
      return 1;
    }
  }
  std::vector<std::string> targets = a.adapters;
  for (std::string& t : targets)
    if (t == "base") t.clear();
  if (targets.empty()) {
    if (!a.no_base) targets.push_back("");
    for (const auto& [name, path] : loras) targets.push_back(name);
  }
  struct Result {
    std::string adapter;
    int prompt = 0;
    std::vector<int32_t> ids;
    RequestOutput final;
  };
  std::vector<Result> results;
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (const std::string& t : targets) results.push_back({t, static_cast<int>(p), {}, {}});
  // Everything is submitted before the engine's next step: one batch mixes all adapters.
  for (size_t i = 0; i < results.size(); ++i) {
    GenerationRequest req;
    req.id = fmt::format("gen-{}", i);
    req.prompt = prompts[results[i].prompt];
    req.adapter = results[i].adapter;
    req.sampling = a.sampling;
    {
      std::lock_guard<std::mutex> lk(mu);
      ++pending;
    }
    Status s = (*engine)->submit(req, [&, i](const RequestOutput& o) {
      std::lock_guard<std::mutex> lk(mu);
      for (const TokenEvent& t : o.tokens) results[i].ids.push_back(t.token);
      if (o.finished) {
        results[i].final = o;
        --pending;
        cv.notify_all();
      }
    });
    if (!s.ok()) {
      std::fprintf(stderr, "moelora generate: %s\n", s.message().c_str());
      return 1;
    }
  }
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return pending == 0; });
  }
  int rc = 0;
  for (const Result& r : results) {
    std::string ids;
    for (int32_t t : r.ids) ids += fmt::format("{}{}", ids.empty() ? "" : " ", t);
    std::printf("prompt %d  adapter %-12s  finish %-6s  ids [%s]\n", r.prompt,
                r.adapter.empty() ? "(base)" : r.adapter.c_str(), finish_reason_name(r.final.reason), ids.c_str());
    if (codec.has_tokenizer()) std::printf("  text: %s\n", codec.quote(codec.decode(r.ids)).c_str());
    if (r.final.reason == FinishReason::kError) {
      std::printf("  error: %s\n", r.final.error.message().c_str());
      rc = 1;
    }
  }
  return rc;
}

}  // namespace

void register_generate(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("generate", "Generate tokens for prompts under the base model and adapters (one batch)");
  auto a = std::make_shared<Args>();
  a->sampling.temperature = 0.0f;
  a->sampling.max_tokens = 16;
  cmd->add_option("--model", a->model, "model folder (default: the tiny model that ships in the repository, with its adapters)");
  cmd->add_option("--lora", a->loras, "NAME=DIR: load an adapter (repeatable)");
  cmd->add_option("--prompt", a->prompts, "prompt text (needs the model's tokenizer.json; repeatable)");
  cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as token ids, e.g. '1,2,3' (repeatable)");
  cmd->add_option("--adapter", a->adapters, "adapter to run each prompt under ('base' for none; repeatable; default: base + all)");
  cmd->add_flag("--no-base", a->no_base, "do not run the prompts under the base model");
  cmd->add_option("--backend", a->backend.name, "cpu or cuda")->capture_default_str();
  cmd->add_option("--max-tokens", a->sampling.max_tokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", a->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", a->sampling.top_k, "0 = off")->capture_default_str();
  cmd->add_option("--top-p", a->sampling.top_p, "1 = off")->capture_default_str();
  cmd->add_option("--min-p", a->sampling.min_p, "0 = off")->capture_default_str();
  cmd->add_option("--seed", a->sampling.seed, "per-request seed (sampled generation)");
  cmd->callback([a, &exit_code] { exit_code = run(*a); });
}

}  // namespace moelora::tools
