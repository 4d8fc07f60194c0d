// Workbench: the attention block of a decode step as the forward pass runs it (model/forward_pass.h
// attention_block: q|k|v, Qwen3's head norms, RoPE, the KV-cache write, decode attention over the
// paged cache, o_proj, with their LoRA; MLA in the model's form for DeepSeek), followed by the
// residual add fused with the next norm (Backend::add_rmsnorm), at Qwen3-30B-A3B, Mixtral-8x7B and
// DeepSeek-V3 shapes (bench/configs), random weights made by Model::random, 8 random adapters of
// rank 16 on every target. Residual in, residual out: what issue 11's targets time.
//
// Each step is the real step machinery (begin_step / end_step_body: padding to a graph bucket,
// capture, replay): embed, then L attention blocks of L layers with their own weights and caches,
// L chosen so that the projections the other L - 1 layers read exceed twice the L2 (a replay reads
// each block's weights from HBM). Every sequence decodes its token at position `context` over a
// cache of `context` positions on pages of its own. Timed: `iters` identical steps queued back to
// back on the device clock, per block = step / L. Checked: the replayed output equals the eager
// step's bit for bit; with --ab the whole table runs again with the small-M GEMMs waiting for
// their LoRA shrink first (CudaBackendOptions::dense_lora_shrink_beside_gemm off), whose outputs
// must be the first run's bit for bit.
//
// Floor (model/step_floor.h attention_block_floor_bytes): projections, the LoRA factors of each
// adapter in the batch, the cache read and written, over the copy bandwidth measured in this run.
//
// --profile T N: only T tokens with N adapters of the first shape named, one replayed step inside
// cudaProfilerStart / Stop, for `ncu --profile-from-start off` (scripts/device_run.sh attnprof).
//
//   dev_attention_block [qwen3|mixtral|deepseek ...] [--iters N] [--context N] [--ab] [--json FILE]
//                       [--profile T N]
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <cuda_profiler_api.h>
#include <nlohmann/json.hpp>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/device_info.h"
#include "core/tensor.h"
#include "dev/block_bench.h"
#include "gpukit/timing.h"
#include "lora/random_adapter.h"
#include "model/forward_pass.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/step_floor.h"

using namespace moelora;

namespace {

using namespace moelora::dev;  // block_bench.h: shapes, adapters, token counts, helpers

struct Options {
  int iters = 20;
  int context = 512;
  bool ab = false;
  std::ofstream* json = nullptr;
  int profile_tokens = -1, profile_adapters = 0;  // --profile T N
};


// The first run's eager output per (tokens, adapters), which the --ab run must repeat bit for bit.
using Outputs = std::map<std::pair<int, int>, std::vector<float>>;

int run_shape(const Shape& shape, bool beside, const Options& o, double copy_gbps, size_t l2_bytes, Outputs& first_run) {
  std::optional<ModelConfig> parsed = dev::bench_config(shape.config);
  if (!parsed) return 2;
  ModelConfig c = *parsed;
  // Dense MLPs only: the block never runs them, and DeepSeek's experts would not fit L layers.
  // L from the projections alone (an empty cache shape: no cache bytes).
  const int L = dev::layers_beyond_l2(attention_block_floor_bytes(c, KvShape{}, 0, 1, 0, 0, 0), l2_bytes);
  c.num_layers = L;
  c.layer_is_moe.assign(L, false);

  CudaBackendOptions opts;
  opts.dense_lora_shrink_beside_gemm = beside;
  CudaBackend b(opts);
  std::unique_ptr<Model> model = dev::random_model(c, b, shape.name, kAdapters, kRank);
  if (!model) return 2;
  DeviceRandomAdapters ad = make_device_random_adapters(c, b, kAdapters, kRank);
  const int max_T = *std::max_element(std::begin(kTokens), std::end(kTokens));
  std::vector<KvLayer> kv = model->alloc_kv_cache(max_T * dev::pages_per_sequence(o.context) + 1, kPageSize);
  const RopeTable rope = make_rope_table(c);
  SingleDeviceContext single(c);
  const ForwardModel fm{model->config(), model->weights(), rope, b, single, model->mla_absorbed()};
  const ModelWeights& w = model->weights();
  const KvShape kvs = model->kv_shape();

  std::printf("\n## %s (%s): H %d, %s; %d layers per step, context %d; LoRA shrinks %s the GEMMs; %s\n", shape.name,
              shape.config, c.hidden_size,
              c.is_mla() ? (model->mla_absorbed() ? "MLA (absorbed)" : "MLA (decompressed)")
                         : (std::to_string(c.num_heads) + " / " + std::to_string(c.num_kv_heads) + " heads of " +
                            std::to_string(c.head_dim))
                               .c_str(),
              L, o.context, beside ? "beside" : "before", c.weight_format.describe().c_str());
  std::printf("%6s %9s %12s %12s %9s %10s %s\n", "tokens", "adapters", "block_us", "floor_us", "x_floor", "lora_tax",
              beside ? "replay == eager" : "replay == eager == beside");
  bool mismatch = false;
  for (int T : kTokens) {
    if (o.profile_tokens >= 0 && T != o.profile_tokens) continue;
    double base_us = 0;
    for (int N : {0, kAdapters}) {
      if (o.profile_tokens >= 0 && N != o.profile_adapters) continue;
      const StepBatch batch = dev::decode_batch(T, N, c.vocab_size, o.context);
      const LoraTables* tables = N > 0 ? &ad.tables : nullptr;
      auto step = [&]() -> Tensor {
        return dev::run_block_step(b, single, c, w, batch, L, &LayerWeights::input_norm,
                                   [&](int l, const Tensor& x) { return attention_block(fm, l, x, kv[l], tables); });
      };
      // Eager (warm-up), capture, then a replay: the replay's output must be the eager one's.
      const std::vector<float> eager = dev::host_values(b, step().slice_rows(0, T));
      (void)step();
      const std::vector<float> replayed = dev::host_values(b, step().slice_rows(0, T));
      const bool same_replay = dev::same_bits(eager, replayed);
      const bool second = first_run.count({T, N}) > 0;
      const bool same_first = !second || dev::same_bits(eager, first_run.at({T, N}));
      if (!second) first_run[{T, N}] = eager;
      std::string why;
      if (!same_replay) why += "  replay vs eager: " + dev::difference(eager, replayed);
      if (!same_first) why += "  eager vs first run: " + dev::difference(eager, first_run.at({T, N}));
      b.synchronize();
      if (o.profile_tokens >= 0) {
        cudaProfilerStart();
        (void)step();
        b.synchronize();
        cudaProfilerStop();
        std::printf("profiled one replay of %d tokens, %d adapters (%d layers): %s\n", T, N, L,
                    same_replay ? "replay == eager" : ("NO" + why).c_str());
        return same_replay ? 0 : 1;
      }
      b.device_timer_begin();
      for (int it = 0; it < o.iters; ++it) (void)step();
      const double block_us = b.device_timer_end_us() / o.iters / L;
      (void)b.take_device_wait_seconds();
      const double floor_us = attention_block_floor_bytes(c, kvs, 0, T, N, kRank, o.context) / (copy_gbps * 1e3);
      if (N == 0) base_us = block_us;
      const double tax = N > 0 ? (block_us / base_us - 1.0) * 100.0 : 0.0;
      const bool same = same_replay && same_first;
      std::printf("%6d %9d %12.1f %12.1f %9.2f %9.0f%% %s\n", T, N, block_us, floor_us, block_us / floor_us, tax,
                  same ? "yes" : ("NO" + why).c_str());
      std::fflush(stdout);
      if (o.json) {
        nlohmann::json r = {{"bench", "attention_block"}, {"model", shape.config},
                            {"layers", L},                {"context", o.context},
                            {"lora_shrink_beside_gemm", beside},
                            {"batch", T},                 {"adapters", N},
                            {"rank", kRank},              {"block_us", block_us},
                            {"floor_us", floor_us},       {"x_floor", block_us / floor_us},
                            {"lora_tax_pct", tax},        {"copy_gbps", copy_gbps},
                            {"replay_equals_eager", same}, {"gpu", b.device_description()}};
        *o.json << r.dump() << "\n";
      }
      if (!same) mismatch = true;  // reported, and the exit status says so; the other points still run
    }
  }
  return mismatch ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<const Shape*> shapes;
  Options o;
  std::string json_path;
  auto usage = [] {
    std::fprintf(stderr,
                 "usage: dev_attention_block [qwen3|mixtral|deepseek ...] [--iters N] [--context N] [--ab] "
                 "[--json FILE] [--profile T N]\n");
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--context" && i + 1 < argc) {
      o.context = std::max(0, std::atoi(argv[++i]));
    } else if (a == "--profile" && i + 2 < argc) {
      o.profile_tokens = std::atoi(argv[++i]);
      o.profile_adapters = std::atoi(argv[++i]);
    } else if (a == "--ab") {
      o.ab = true;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      const Shape* found = shape_named(a);
      if (!found) return usage();
      shapes.push_back(found);
    }
  }
  if (shapes.empty())
    for (const Shape& s : kShapes) shapes.push_back(&s);
  if (o.profile_tokens >= 0) shapes.resize(1);
  const double copy_gbps = gpukit::print_ceilings("attention_block");
  const size_t l2 = cuda::query_device().l2_bytes;
  std::ofstream json;
  if (!json_path.empty()) {
    json.open(json_path, std::ios::app);
    o.json = &json;
  }
  int rc = 0;
  for (const Shape* s : shapes) {
    Outputs first_run;
    const int beside = run_shape(*s, true, o, copy_gbps, l2, first_run);
    rc = std::max(rc, beside);
    if (o.ab && beside != 2) rc = std::max(rc, run_shape(*s, false, o, copy_gbps, l2, first_run));
  }
  return rc;
}
