// A model is a config and its weights on one backend. Its forward pass is forward_body
// (forward_pass.h, shared by every architecture and by the ranks of a sharded model) with the
// single-device ParallelContext; this class adds the step bookkeeping (graph capture / replay).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

// Rotary tables as transformers computes them (default, linear and YaRN scaling).
RopeTable make_rope_table(const ModelConfig& cfg);

// How an MLA model (DeepSeek-V3) runs attention. Decompressed: kv_b expands each token's latent
// into per-head k_nope / v, and the KV cache holds per-head K and V. Absorbed: kv_b (and its
// LoRA) is applied on the query and output sides (Backend::mla_attention_absorbed) and the cache
// holds the latent (kv_lora_rank + rope values per token). Auto: absorbed where the backend
// supports it (Backend::supports_mla_absorbed), else decompressed. Models without MLA ignore it.
enum class MlaMode { kAuto, kDecompressed, kAbsorbed };
const char* mla_mode_name(MlaMode m);
// "auto", "decompressed" or "absorbed".
Result<MlaMode> parse_mla_mode(const std::string& text);

struct ModelOptions {
  MlaMode mla = MlaMode::kAuto;
};

// What one decoder layer's KV cache holds per position (the arguments of Backend::alloc_kv_layer):
// GQA: kv heads of head_dim K and V; MLA decompressed: every head's K (nope + rope) and V;
// MLA absorbed: one "head" of kv_lora_rank + rope values (the latent c, then k_pe) and no V.
struct KvShape {
  int kv_heads = 0;
  int k_head_dim = 0;
  int v_head_dim = 0;
  int64_t values_per_token() const { return int64_t{kv_heads} * (k_head_dim + v_head_dim); }
};
KvShape kv_shape(const ModelConfig& cfg, bool mla_absorbed);

// The shapes Backend::check_model_shapes judges (adapter capacity left 0: the engine adds it), for
// a model running MLA in the absorbed form or not (ignored without MLA).
ModelShapes model_shapes(const ModelConfig& cfg, bool mla_absorbed = false);

class Model {
 public:
  // Loads config.json and the checkpoint in `dir` onto `backend` (which must outlive the model).
  // A model whose shapes the backend's kernels cannot take is refused before any weight is read
  // (Backend::check_model_shapes, judged in the MLA form chosen for it).
  // MlaMode::kAbsorbed on a backend without the absorbed op is refused.
  static Result<std::unique_ptr<Model>> load(const std::string& dir, Backend& backend, const ModelOptions& opts = {});
  // A model of `cfg`'s shapes with pseudo-random weights made on the backend (benchmarks):
  // FP8 block-scaled linears when cfg declares FP8 and the backend keeps FP8, else its float type.
  // Refused like load() when the backend's kernels cannot take the shapes.
  static Result<std::unique_ptr<Model>> random(const ModelConfig& cfg, Backend& backend, uint64_t seed,
                                               const ModelOptions& opts = {});

  const ModelConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  Backend& backend() const { return backend_; }
  const ModelWeights& weights() const { return weights_; }

  // MLA in the absorbed form (decided once at load; false for models without MLA).
  bool mla_absorbed() const { return mla_absorbed_; }
  // Per position of one layer's KV cache, in this model's attention form.
  KvShape kv_shape() const { return moelora::kv_shape(cfg_, mla_absorbed_); }
  // The shapes its backend judged at load, in this model's attention form.
  ModelShapes shapes() const { return model_shapes(cfg_, mla_absorbed_); }

  // One KV layer per decoder layer, `num_pages` pages of `page_size` positions each.
  std::vector<KvLayer> alloc_kv_cache(int num_pages, int page_size) const;

  // Runs one step of the batch (prefill chunks and decode tokens mixed) and returns the logits
  // of batch.logit_rows as a backend float32 tensor [rows, vocab], valid until the backend's next
  // step (the engine samples from it on the device). `lora` may be null (no adapters).
  Tensor forward_logits(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora);
  // forward_logits copied to a host float32 tensor (verify, tests).
  Tensor forward(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora);

 private:
  Model(ModelConfig cfg, std::string dir, Backend& backend) : cfg_(std::move(cfg)), dir_(std::move(dir)), backend_(backend) {}
  // Decides the MLA form for `opts` on this backend (before any weight is read).
  Status choose_mla_form(const ModelOptions& opts);
  // q|k|v and gate|up in one weight each where the backend fuses them (model/fused_projections.h).
  void fuse_projections();

  ModelConfig cfg_;
  std::string dir_;
  Backend& backend_;
  ModelWeights weights_;
  RopeTable rope_;
  bool mla_absorbed_ = false;
};

}  // namespace moelora
