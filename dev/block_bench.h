// Shared pieces of the block workbenches (moe_block.cu, attention_block.cu): a bench config read
// from bench/configs, the backend's values on the host, and the bit-for-bit comparison of a
// replayed step with its eager one that both report.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "model/parallel_context.h"
#include "ops/backend.h"

namespace moelora::dev {

// What both workbenches run: 8 random adapters of rank 16 on every target, 16-position KV pages,
// these token counts, at these bench configs.
constexpr int kAdapters = 8, kRank = 16, kPageSize = 16;
constexpr int kTokens[] = {1, 8, 64, 128, 256};
struct Shape {
  const char* name;
  const char* config;  // under bench/configs
};
constexpr Shape kShapes[] = {{"qwen3", "qwen3-30b-a3b-fp8.json"},
                             {"mixtral", "mixtral-8x7b-fp8.json"},
                             {"deepseek", "deepseek-v3-fp8.json"}};

// The shape of that name (qwen3, mixtral, deepseek), or null.
inline const Shape* shape_named(const std::string& name) {
  for (const Shape& s : kShapes)
    if (name == s.name) return &s;
  return nullptr;
}

// Layers per step such that what the other layers read exceeds twice the L2 (at least 2), given
// what one layer's block reads: a replay then reads each block's weights from HBM, not from the
// previous replay's L2 lines.
inline int layers_beyond_l2(double per_layer_bytes, size_t l2_bytes) {
  return 1 + std::max(1, static_cast<int>(std::ceil(2.0 * static_cast<double>(l2_bytes) / per_layer_bytes)));
}

// KV pages a sequence decoding at position `context` spans.
inline int pages_per_sequence(int context) { return (context + 1 + kPageSize - 1) / kPageSize; }

// T sequences of one token each, token t with adapter slot t % adapters (none without adapters),
// decoding position `context` over pages [t * pages, (t + 1) * pages) of its own.
inline StepBatch decode_batch(int T, int adapters, int vocab, int context) {
  const int pages = pages_per_sequence(context);
  StepBatch s;
  for (int t = 0; t < T; ++t) {
    s.token_ids.push_back((t * 7919 + 13) % vocab);
    s.positions.push_back(context);
    s.token_seq.push_back(t);
    s.token_slot.push_back(adapters > 0 ? t % adapters : -1);
    std::vector<int32_t> own;
    for (int p = 0; p < pages; ++p) own.push_back(t * pages + p);
    s.seq_pages.push_back(own);
    s.logit_rows.push_back(t);
  }
  return s;
}

// bench/configs/<file>, read from the repository root; nullopt (and a message) if it cannot be.
inline std::optional<ModelConfig> bench_config(const std::string& file) {
  const std::string path = "bench/configs/" + file;
  auto text = read_text_file(path);
  if (!text.ok()) {
    std::fprintf(stderr, "%s: %s (run from the repository root)\n", path.c_str(), text.status().message().c_str());
    return std::nullopt;
  }
  auto parsed = parse_model_config(*text, path);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", parsed.status().message().c_str());
    return std::nullopt;
  }
  return *parsed;
}

// A model of c's shapes with random weights (seed 7) on b, whose kernels must take it with
// `adapters` LoRA slots of rank `rank`; null (and a message naming `what`) if either fails.
inline std::unique_ptr<Model> random_model(const ModelConfig& c, Backend& b, const char* what, int adapters, int rank) {
  auto made = Model::random(c, b, 7);
  if (!made.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, made.status().message().c_str());
    return nullptr;
  }
  std::unique_ptr<Model> model = std::move(made).value();
  ModelShapes with_adapters = model->shapes();
  with_adapters.lora_slots = adapters;
  with_adapters.max_lora_rank = rank;
  if (Status st = b.check_model_shapes(with_adapters); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    return nullptr;
  }
  return model;
}

// One step of `layers` blocks through the backend's step machinery (begin_step / end_step_body:
// graph buckets, capture, replay): embed, the first layer's `norm`, then per layer block(l, x),
// its residual add fused with the next layer's `norm` (Backend::add_rmsnorm, as the forward pass
// fuses it), the last one's add alone. Returns the residual stream [padded tokens, hidden].
template <typename Block>
Tensor run_block_step(Backend& b, ParallelContext& par, const ModelConfig& c, const ModelWeights& w,
                      const StepBatch& batch, int layers, Tensor LayerWeights::*norm, Block block) {
  const StepBatch& s = b.begin_step(batch);
  if (b.step_mode() == Backend::StepMode::kReplay) return b.step_output();
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int T = s.num_tokens();
  Tensor h = b.alloc_act(T, c.hidden_size);
  par.embed(b, s, w.embed, h);
  Tensor x = b.alloc_act(T, c.hidden_size);
  b.rmsnorm(h, w.layers[0].*norm, eps, x);
  for (int l = 0; l < layers; ++l) {
    const size_t mark = b.scratch_mark();
    Tensor out = block(l, x);
    if (l + 1 < layers)
      b.add_rmsnorm(out, h, w.layers[l + 1].*norm, eps, x);
    else
      b.add(out, h);
    b.scratch_release(mark);
  }
  b.end_step_body(h);
  return h;
}

inline std::vector<float> host_values(Backend& b, const Tensor& t) {
  Tensor h = b.to_host_f32(t);
  const float* p = h.ptr<float>();
  return std::vector<float>(p, p + h.numel());
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How two outputs differ: elements whose bits differ, and the largest |difference|.
inline std::string difference(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ++n;
      worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
    }
  return std::to_string(n) + " of " + std::to_string(a.size()) + " differ, max |d| " + std::to_string(worst);
}

}  // namespace moelora::dev
