// moelora bench: decode / prefill step time of a full-size model (shapes from a config.json) with
// random weights made on the device, for batch sizes x numbers of distinct adapters, against the
// memory floor of the same shapes (weights touched + LoRA factors touched + KV read, over HBM
// bandwidth; docs/floors.md).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "io/mapped_file.h"
#include "lora/random_adapter.h"
#include "model/archs.h"
#include "model/model.h"
#include "model/step_floor.h"
#include "runtime/backend_factory.h"
#include "tools/bench_record.h"
#include "tools/commands.h"
#include "tools/common.h"

namespace moelora::tools {

namespace {

struct Args {
  std::string config;
  BackendOptions backend;
  int layers = 0;
  std::string mla = "auto";  // DeepSeek MLA's form: a parse_mla_mode spelling (checked by the option)
  std::vector<int> batches = {1, 8, 64, 128};
  std::vector<int> adapters = {0, 1, 8};
  int rank = 16;
  int context = 512;
  int prefill = 0;  // > 0: also time a prefill step of this many tokens per sequence
  int iters = 10;
  double hbm_tbps = 4.3;  // H200 copy bandwidth measured in this workplace
  std::string json;       // append one JSON record per point (bench_record.h)
};

// What one measured step consists of.
enum class StepKind {
  kKernels,  // forward only, `iters` steps queued back to back: the device time of the kernels
  kLogits,   // forward, then wait for the logits (no sampling)
  kSampled,  // forward + seeded top-p sampling on the backend: what the engine runs
};

struct Timing {
  double wall_us = 0;  // median over the timed steps
  double host_us = 0;  // median of wall minus time blocked on the device
};

int run(Args a) {
  std::string path = a.config;
  if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "config.json").string();
  auto text = read_text_file(path);
  if (!text.ok()) {
    std::fprintf(stderr, "moelora bench: %s\n", text.status().message().c_str());
    return 2;
  }
  auto cfg = parse_model_config(*text, path);
  if (!cfg.ok()) {
    std::fprintf(stderr, "moelora bench: %s\n", cfg.status().message().c_str());
    return 2;
  }
  ModelConfig c = *cfg;
  const std::string model_name = std::filesystem::path(a.config).filename().replace_extension().string();
  if (a.layers > 0 && a.layers < c.num_layers) {  // a slice of a model too large for one GPU
    c.num_layers = a.layers;
    c.layer_is_moe.resize(a.layers);
  }
  auto backend = make_backend(a.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "moelora bench: %s\n", backend.status().message().c_str());
    return 2;
  }
  Backend& b = **backend;
  ModelOptions mopts;
  mopts.mla = *parse_mla_mode(a.mla);  // --mla admits only the three spellings
  auto made = Model::random(c, b, 7, mopts);  // refused when the backend's kernels cannot take the shapes
  if (!made.ok()) {
    std::fprintf(stderr, "moelora bench: %s\n", made.status().message().c_str());
    return 2;
  }
  std::unique_ptr<Model> model = std::move(made).value();
  const int max_n = *std::max_element(a.adapters.begin(), a.adapters.end());
  // The random adapters go straight into backend slots: their count and rank meet the kernels'
  // limits here, not in an abort.
  ModelShapes with_adapters = model->shapes();
  with_adapters.lora_slots = std::max(1, max_n);
  with_adapters.max_lora_rank = a.rank;
  if (Status st = b.check_model_shapes(with_adapters); !st.ok()) {
    std::fprintf(stderr, "moelora bench: --adapters %d --rank %d: %s\n", max_n, a.rank, st.message().c_str());
    return 2;
  }
  DeviceRandomAdapters ad = make_device_random_adapters(c, b, std::max(1, max_n), a.rank);
  const int max_b = *std::max_element(a.batches.begin(), a.batches.end());
  const int page = 16, per_seq = (a.context + a.iters + 8 + std::max(a.prefill, 1)) / page + 2;
  auto kv = model->alloc_kv_cache(per_seq * max_b, page);
  std::printf("bench: %s (%s), %d layers, backend %s, %s, rank %d, context %d, floor at %.1f TB/s\n",
              arch_name(c.arch), path.c_str(), c.num_layers, b.name().c_str(), c.weight_format.describe().c_str(), a.rank,
              a.context, a.hbm_tbps);
  // What one token costs in the KV cache (the cache's dtype is the backend's activation type).
  const KvShape kvs = model->kv_shape();
  const std::string mla_form = !c.is_mla() ? "" : model->mla_absorbed() ? "absorbed" : "decompressed";
  const double kv_token_bytes =
      static_cast<double>(kvs.values_per_token()) * c.num_layers * dtype_size(b.act_dtype());
  std::printf("kv cache: %lld values per token per layer%s, %.1f KiB per token over %d layers\n",
              static_cast<long long>(kvs.values_per_token()), mla_form.empty() ? "" : (" (MLA " + mla_form + ")").c_str(),
              kv_token_bytes / 1024.0, c.num_layers);
  // step_us: forward + seeded top-p sampling, synchronous (as the engine steps); logits_us: the
  // same without sampling; kernel_us: device time per step with steps queued back to back;
  // host_us: step time the host was not waiting for the device; x_logits: sampling's cost.
  std::printf("%6s %9s %12s %12s %12s %10s %12s %12s %10s %9s\n", "batch", "adapters", "step_us", "tok/s", "floor_us",
              "x_floor", "logits_us", "kernel_us", "host_us", "x_logits");
  for (int B : a.batches)
    for (int N : a.adapters) {
      auto step_batch = [&](int pos, int tokens_per_seq) {
        StepBatch s;
        for (int q = 0; q < B; ++q) {
          std::vector<int32_t> pages;
          for (int p = 0; p < per_seq; ++p) pages.push_back(q * per_seq + p);
          s.seq_pages.push_back(pages);
          for (int i = 0; i < tokens_per_seq; ++i) {
            s.token_ids.push_back((q * 31 + pos + i) % c.vocab_size);
            s.positions.push_back(pos + i);
            s.token_seq.push_back(q);
            s.token_slot.push_back(N > 0 ? q % N : -1);
          }
          s.logit_rows.push_back(s.num_tokens() - 1);
        }
        return s;
      };
      const LoraTables* tables = N > 0 ? &ad.tables : nullptr;
      // Sampling as a chat request asks for it: temperature, top-p, a seed per request.
      std::vector<SampleRow> rows(B);
      for (int q = 0; q < B; ++q) rows[q].temperature = 0.8f, rows[q].top_p = 0.9f, rows[q].seed = 1000 + q;
      int pos = a.context;
      auto measure = [&](StepKind kind) {
        std::vector<double> wall, host;
        if (kind == StepKind::kKernels) {
          // The same step queued `iters` times: the host runs ahead, so the device time per step
          // is the kernels' (identical batches make the reused staging buffers harmless).
          StepBatch s = step_batch(pos, 1);
          model->forward_logits(s, kv, tables);
          b.synchronize();
          b.device_timer_begin();
          for (int it = 0; it < a.iters; ++it) model->forward_logits(s, kv, tables);
          const double dev = b.device_timer_end_us();
          (void)b.take_device_wait_seconds();
          return Timing{dev / a.iters, 0.0};
        }
        for (int it = 0; it < a.iters + 3; ++it) {  // 3 warm-up steps: eager, capture, first replay
          StepBatch s = step_batch(pos++, 1);
          (void)b.take_device_wait_seconds();
          auto t0 = std::chrono::steady_clock::now();
          Tensor logits = model->forward_logits(s, kv, tables);
          if (kind == StepKind::kLogits) b.synchronize();
          else {
            for (int q = 0; q < B; ++q) rows[q].step = static_cast<uint64_t>(it);
            (void)b.sample(logits, rows);
          }
          const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
          const double wait_us = b.take_device_wait_seconds() * 1e6;
          if (it >= 3) wall.push_back(us), host.push_back(std::max(0.0, us - wait_us));
        }
        std::sort(wall.begin(), wall.end());
        std::sort(host.begin(), host.end());
        return Timing{wall[wall.size() / 2], host[host.size() / 2]};
      };
      const Timing sampled = measure(StepKind::kSampled);
      const Timing logits_only = measure(StepKind::kLogits);
      const Timing kernels = measure(StepKind::kKernels);
      const double med = sampled.wall_us;
      const double floor_us =
          decode_step_floor_bytes(c, model->kv_shape(), B, N, a.rank, a.context) / (a.hbm_tbps * 1e12) * 1e6;
      std::printf("%6d %9d %12.1f %12.0f %12.1f %10.2f %12.1f %12.1f %10.1f %9.3f\n", B, N, med, B / (med * 1e-6),
                  floor_us, med / floor_us, logits_only.wall_us, kernels.wall_us, sampled.host_us,
                  med / logits_only.wall_us);
      append_record(a.json,
                    {{"bench", "decode_step"}, {"model", model_name},
                     {"config", path}, {"layers", c.num_layers}, {"backend", b.name()},
                     {"graphs", a.backend.cuda_graphs}, {"mla", mla_form}, {"kv_bytes_per_token", kv_token_bytes},
                     {"batch", B}, {"adapters", N}, {"rank", a.rank},
                     {"context", a.context}, {"sampling", "temperature 0.8, top_p 0.9, seeded"},
                     {"step_us", med}, {"logits_us", logits_only.wall_us}, {"kernel_us", kernels.wall_us},
                     {"host_us", sampled.host_us}, {"floor_us", floor_us}, {"x_floor", med / floor_us},
                     {"tok_s", B / (med * 1e-6)}},
                    b.device_description());
      if (a.prefill > 0) {
        StepBatch s = step_batch(0, a.prefill);
        model->forward_logits(s, kv, tables);
        b.synchronize();
        auto t0 = std::chrono::steady_clock::now();
        model->forward_logits(s, kv, tables);
        b.synchronize();
        const double pu = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        std::printf("%6s prefill %d x %d tokens: %.1f us, %.0f tok/s\n", "", B, a.prefill, pu, B * a.prefill / (pu * 1e-6));
        append_record(a.json,
                      {{"bench", "prefill"}, {"model", model_name}, {"config", path},
                       {"layers", c.num_layers}, {"backend", b.name()}, {"mla", mla_form}, {"batch", B},
                       {"prompt_tokens", a.prefill},
                       {"adapters", N}, {"rank", a.rank}, {"step_us", pu}, {"tok_s", B * a.prefill / (pu * 1e-6)}},
                      b.device_description());
      }
      std::fflush(stdout);
    }
  return 0;
}

}  // namespace

void register_bench(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "Step time of a full-size model with random weights, vs its memory floor");
  auto a = std::make_shared<Args>();
  cmd->add_option("--config", a->config, "a config.json or a folder holding one (only shapes are read)")->required();
  cmd->add_option("--backend", a->backend.name, "cpu or cuda")->capture_default_str();
  add_cuda_backend_flags(cmd, a->backend);
  cmd->add_option("--layers", a->layers, "use only the first N layers (models larger than one GPU)");
  cmd->add_option("--mla", a->mla,
                  "MLA attention (DeepSeek-V3): auto (absorbed where the backend has it), decompressed or absorbed")
      ->check(CLI::IsMember({mla_mode_name(MlaMode::kAuto), mla_mode_name(MlaMode::kDecompressed),
                             mla_mode_name(MlaMode::kAbsorbed)}))
      ->capture_default_str();
  cmd->add_option("--batch", a->batches, "decode batch sizes")->delimiter(',')->capture_default_str();
  cmd->add_option("--adapters", a->adapters, "distinct adapters per batch (0 = base)")->delimiter(',')->capture_default_str();
  cmd->add_option("--rank", a->rank, "LoRA rank on every linear layer incl. experts")->capture_default_str();
  cmd->add_option("--context", a->context, "tokens already in each sequence's KV cache")->capture_default_str();
  cmd->add_option("--prefill", a->prefill, "also time a prefill of N tokens per sequence")->capture_default_str();
  cmd->add_option("--iters", a->iters, "timed steps per point (median reported)")->capture_default_str();
  cmd->add_option("--hbm-tbps", a->hbm_tbps, "bandwidth for the floor")->capture_default_str();
  cmd->add_option("--json", a->json, "append one JSON record per measured point to this file");
  cmd->callback([a, &exit_code] { exit_code = run(*a); });
}

}  // namespace moelora::tools
