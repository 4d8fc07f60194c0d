// Workbench: the whole MoE block as the forward pass runs it (model/forward_pass.h moe_block: the
// router GEMM, top-k softmax or DeepSeek's grouped sigmoid with its bias, the routed experts, the
// shared experts, their LoRA) at Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 shapes
// (bench/configs), random weights made by Model::random, 8 random adapters of rank 16 on every
// target. Where dev_moe_bench times the routed experts' kernels alone, this is what one MoE layer
// of a decode step costs, CudaBackend's choices and all.
//
// Each step is the real step machinery (begin_step / end_step_body: padding to a graph bucket,
// capture, replay): embed, then L MoE blocks, each followed by the residual add fused with the next
// block's norm (Backend::add_rmsnorm, as the forward pass fuses it). The blocks belong to L layers
// with their own weights, L chosen so that the experts the other L - 1 layers touch at one token
// exceed twice the L2: a replay reads each block's experts from HBM, not from the previous
// replay's L2 lines. A model with shared experts (DeepSeek) runs twice: the shared experts after the
// routed ones, then beside them on a stream of their own (CudaBackendOptions::
// shared_experts_concurrent), whose outputs must be the first run's bit for bit. Timed: `iters` identical steps queued back to back on the device clock
// (Backend::device_timer_*), per block = step / L (the one embedding lookup per step and the gap
// between graph launches are spread over the L blocks). Checked: the replayed output equals the
// eager step's, bit for bit.
//
// Floor (model/step_floor.h moe_block_floor_bytes): router, the expected distinct experts, shared
// experts and the LoRA factors of each adapter's experts, over the copy bandwidth measured in this
// run. The peers' figures (vLLM fused_moe) are the routed experts alone: compare them with
// dev_moe_bench, this with the decode step.
//
//   dev_moe_block [qwen3|mixtral|deepseek ...] [--iters N] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/device_info.h"
#include "core/tensor.h"
#include "dev/block_bench.h"
#include "lora/random_adapter.h"
#include "model/forward_pass.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/step_floor.h"
#include "gpukit/timing.h"

using namespace moelora;

namespace {

using namespace moelora::dev;  // block_bench.h: shapes, adapters, token counts, helpers

// Layers such that the experts the other ones touch at one token exceed 2x the L2 (at least 2).
int layers_for(const ModelConfig& c, size_t l2_bytes) {
  const double touched = static_cast<double>(c.top_k) * 3.0 * c.hidden_size * c.moe_intermediate_size *
                         c.weight_format.bytes_per_weight();
  return dev::layers_beyond_l2(touched, l2_bytes);
}

// The eager step's output per (tokens, adapters) of a model's first run, which its run with the
// shared experts concurrent must repeat bit for bit.
using Outputs = std::map<std::pair<int, int>, std::vector<float>>;

// CudaBackendOptions::overlap: the routed experts' LoRA on its side stream (`--no-overlap`: on main).
bool lora_side_stream = true;

int run_shape(const Shape& shape, bool concurrent, int iters, double copy_gbps, size_t l2_bytes, Outputs& first_run,
              std::ofstream* json) {
  std::optional<ModelConfig> parsed = dev::bench_config(shape.config);
  if (!parsed) return 2;
  ModelConfig c = *parsed;
  const int L = layers_for(c, l2_bytes);
  c.num_layers = L;
  c.layer_is_moe.assign(L, true);

  CudaBackendOptions opts;
  opts.shared_experts_concurrent = concurrent;
  opts.overlap = lora_side_stream;
  CudaBackend b(opts);
  std::unique_ptr<Model> model = dev::random_model(c, b, shape.name, kAdapters, kRank);
  if (!model) return 2;
  DeviceRandomAdapters ad = make_device_random_adapters(c, b, kAdapters, kRank);
  // The MoE blocks read no KV, but decode steps are captured only once a cache exists (its
  // reserved padding page).
  std::vector<KvLayer> kv = model->alloc_kv_cache(256 + 1, kPageSize);
  (void)kv;
  const RopeTable rope = make_rope_table(c);
  SingleDeviceContext single(c);
  const ForwardModel fm{model->config(), model->weights(), rope, b, single, model->mla_absorbed()};
  const ModelWeights& w = model->weights();

  const std::string shared =
      c.n_shared_experts == 0 ? ""
                              : ", " + std::to_string(c.n_shared_experts) + " shared" +
                                    (concurrent ? " (beside the routed ones)" : " (after the routed ones)");
  std::printf("\n## %s (%s): H %d, %d experts top-%d, I %d%s, router %s; %d layers per step; %s\n", shape.name,
              shape.config, c.hidden_size, c.num_experts, c.top_k, c.moe_intermediate_size, shared.c_str(),
              c.router == RouterKind::kSigmoidGroupTopK ? "grouped sigmoid + bias" : "softmax", L,
              c.weight_format.describe().c_str());
  std::printf("%6s %9s %12s %12s %9s %10s %s\n", "tokens", "adapters", "block_us", "floor_us", "x_floor", "lora_tax",
              concurrent ? "replay == eager == serial" : "replay == eager");
  bool mismatch = false;
  for (int T : kTokens) {
    double base_us = 0;
    for (int N : {0, kAdapters}) {
      const StepBatch batch = dev::decode_batch(T, N, c.vocab_size, /*context=*/0);  // one page each
      const LoraTables* tables = N > 0 ? &ad.tables : nullptr;
      auto step = [&]() -> Tensor {
        return dev::run_block_step(b, single, c, w, batch, L, &LayerWeights::post_attention_norm,
                                   [&](int l, const Tensor& x) { return moe_block(fm, l, x, tables); });
      };
      // Eager (warm-up), capture, then a replay: the replay's output must be the eager one's.
      const std::vector<float> eager = dev::host_values(b, step().slice_rows(0, T));
      (void)step();
      const std::vector<float> replayed = dev::host_values(b, step().slice_rows(0, T));
      const bool same_replay = dev::same_bits(eager, replayed);
      const bool same_serial = !concurrent || dev::same_bits(eager, first_run.at({T, N}));
      const bool same = same_replay && same_serial;
      if (!concurrent) first_run[{T, N}] = eager;
      // Which comparison failed and by how much.
      std::string why;
      if (!same_replay) why += "  replay vs eager: " + dev::difference(eager, replayed);
      if (!same_serial) why += "  eager vs serial: " + dev::difference(eager, first_run.at({T, N}));
      b.synchronize();
      b.device_timer_begin();
      for (int it = 0; it < iters; ++it) (void)step();
      const double block_us = b.device_timer_end_us() / iters / L;
      (void)b.take_device_wait_seconds();
      const double floor_us = moe_block_floor_bytes(c, 0, T, N, kRank) / (copy_gbps * 1e3);
      if (N == 0) base_us = block_us;
      const double tax = N > 0 ? (block_us / base_us - 1.0) * 100.0 : 0.0;
      std::printf("%6d %9d %12.1f %12.1f %9.2f %9.0f%% %s\n", T, N, block_us, floor_us, block_us / floor_us, tax,
                  same ? "yes" : ("NO" + why).c_str());
      std::fflush(stdout);
      if (json) {
        nlohmann::json r = {{"bench", "moe_block"}, {"model", shape.config},  {"layers", L},
                            {"shared_experts_concurrent", concurrent},
                            {"batch", T},           {"adapters", N},          {"rank", kRank},
                            {"block_us", block_us}, {"floor_us", floor_us},   {"x_floor", block_us / floor_us},
                            {"lora_tax_pct", tax},  {"copy_gbps", copy_gbps}, {"replay_equals_eager", same},
                            {"gpu", b.device_description()}};
        *json << r.dump() << "\n";
      }
      if (!same) mismatch = true;  // reported, and the exit status says so; the other points still run
    }
  }
  return mismatch ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<const Shape*> shapes;
  int iters = 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--no-overlap") {
      lora_side_stream = false;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      const Shape* found = shape_named(a);
      if (!found) {
        std::fprintf(stderr, "usage: dev_moe_block [qwen3|mixtral|deepseek ...] [--iters N] [--json FILE] [--no-overlap]\n");
        return 2;
      }
      shapes.push_back(found);
    }
  }
  if (shapes.empty())
    for (const Shape& s : kShapes) shapes.push_back(&s);
  const double copy_gbps = gpukit::print_ceilings("moe_block");
  const size_t l2 = cuda::query_device().l2_bytes;
  std::ofstream json;
  if (!json_path.empty()) json.open(json_path, std::ios::app);
  int rc = 0;
  std::ofstream* records = json_path.empty() ? nullptr : &json;
  for (const Shape* s : shapes) {
    Outputs first_run;
    const int serial = run_shape(*s, false, iters, copy_gbps, l2, first_run, records);
    rc = std::max(rc, serial);
    if (serial != 2 && std::string(s->name) == "deepseek")
      rc = std::max(rc, run_shape(*s, true, iters, copy_gbps, l2, first_run, records));
  }
  return rc;
}
