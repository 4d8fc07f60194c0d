// A model is a config, its weights on a backend and one forward function (shared by every
// architecture; it branches on the config for GQA vs MLA and dense vs MoE layers).
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

class Model {
 public:
  // Loads config.json and the checkpoint in `dir` onto `backend` (which must outlive the model).
  static Result<std::unique_ptr<Model>> load(const std::string& dir, Backend& backend);
  // A model of `cfg`'s shapes with pseudo-random weights made on the backend (benchmarks):
  // FP8 block-scaled linears when cfg.fp8 and the backend keeps FP8, else its float type.
  static std::unique_ptr<Model> random(const ModelConfig& cfg, Backend& backend, uint64_t seed);

  const ModelConfig& config() const { return cfg_; }
  const std::string& dir() const { return dir_; }
  Backend& backend() const { return backend_; }
  const ModelWeights& weights() const { return weights_; }

  // One KV layer per decoder layer, `num_pages` pages of `page_size` positions each.
  std::vector<KvLayer> alloc_kv_cache(int num_pages, int page_size) const;

  // Runs one step of the batch (prefill chunks and decode tokens mixed) and returns the logits
  // of batch.logit_rows as a host float32 tensor [rows, vocab]. `lora` may be null (no adapters).
  Tensor forward(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora);

 private:
  Model(ModelConfig cfg, std::string dir, Backend& backend) : cfg_(std::move(cfg)), dir_(std::move(dir)), backend_(backend) {}
  Tensor forward_body(const StepBatch& batch, std::vector<KvLayer>& kv, const LoraTables* lora);
  Tensor attention_gqa(int layer, const Tensor& x, KvLayer& kv, const LayerLoraTables* lora);
  Tensor attention_mla(int layer, const Tensor& x, KvLayer& kv, const LayerLoraTables* lora);
  Tensor mlp(const MlpWeights& w, const Tensor& x, const LayerLoraTables* lora, bool shared);
  Tensor moe(int layer, const Tensor& x, const LayerLoraTables* lora);

  ModelConfig cfg_;
  std::string dir_;
  Backend& backend_;
  ModelWeights weights_;
  RopeTable rope_;
};

}  // namespace moelora
