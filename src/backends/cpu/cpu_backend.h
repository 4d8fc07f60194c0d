// The CPU backend: the Backend interface on top of the reference ops in cpu_ops.h. Weights are
// held as float32 (FP8 dequantised exactly at load); activations and KV cache are float32.
#pragma once

#include <memory>
#include <vector>

#include "ops/backend.h"

namespace moelora {

// `bf16_activations` emulates the GPU's storage: every activation an op writes is rounded to
// bf16 (router and final logits stay f32, as on the GPU), and so are LoRA factors. It exists to
// tell which GPU deviations come from bf16 storage alone (docs/numerics.md).
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(bool bf16_activations = false) : bf16_(bf16_activations) {}
  std::string name() const override { return bf16_ ? "cpu-bf16" : "cpu"; }
  Device device() const override { return Device::kCpu; }
  DType act_dtype() const override { return DType::kF32; }

  Tensor upload(const Tensor& host, DType dtype) override;
  LinearWeight upload_linear(const StoredWeight& w) override;
  ExpertWeights upload_experts(const std::vector<StoredWeight>& gate, const std::vector<StoredWeight>& up,
                               const std::vector<StoredWeight>& down) override;
  Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) override;
  KvLayer alloc_kv_layer(int num_pages, int page_size, int kv_heads, int k_head_dim, int v_head_dim) override;
  DType lora_dtype() const override { return DType::kF32; }
  LoraModuleTable alloc_lora_table(int num_slots, int in, int out) override;
  MoeLoraTable alloc_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate) override;
  void set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) override;
  void set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) override;

  const StepBatch& begin_step(const StepBatch& batch) override;
  Tensor alloc(int64_t rows, int64_t cols, DType dtype) override;
  Tensor alloc_act(int64_t rows, int64_t cols) override;
  size_t scratch_mark() override { return scratch_.size(); }
  // Released activations stop being activations: a later f32 buffer (router or final logits) may
  // get the same address and must not be rounded to bf16.
  void scratch_release(size_t mark) override {
    scratch_.resize(mark);
    while (!act_ranges_.empty() && act_ranges_.back().index >= mark) act_ranges_.pop_back();
  }
  void embed(const Tensor& table, Tensor out) override;
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) override;
  void linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora, Tensor out) override;
  void linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts, Tensor out) override;
  LinearWeight fuse_linear_rows(const std::vector<const LinearWeight*>& parts) override;
  void rope(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) override;
  void attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale,
                 Tensor out) override;
  void silu_mul(const Tensor& gate, const Tensor& up, Tensor out) override;
  void add(const Tensor& x, Tensor inout) override;
  void router_logits(const Tensor& x, const LinearWeight& gate, Tensor out) override;
  void topk_softmax(const Tensor& logits, int k, bool renormalize, Tensor ids, Tensor weights) override;
  void topk_sigmoid_grouped(const Tensor& logits, const Tensor& bias, int k, int n_group, int topk_group,
                            bool renormalize, float scaling, Tensor ids, Tensor weights) override;
  void moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
           const MoeLoraTable* lora, Tensor out) override;
  void gather_logit_rows(const Tensor& x, Tensor out) override;
  void mla_split_kv(const Tensor& kv, const Tensor& k_pe, int heads, int nope, int v_dim, Tensor k,
                    Tensor v) override;
  bool supports_mla_absorbed() const override { return true; }
  void mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe, const LinearWeight& kv_b,
                              const LoraModuleTable* kv_b_lora, KvLayer& kv, int heads, int nope, int v_dim,
                              float scale, Tensor out) override;
  Tensor to_host_f32(const Tensor& t) override;
  std::vector<SampleOutput> sample(const Tensor& logits, const std::vector<SampleRow>& rows) override;
  void reserve_penalty_slots(int n, int vocab) override;
  int penalty_slots() const override { return penalty_slots_; }
  void penalty_reset(int slot, const std::vector<int32_t>& tokens, int prompt_len) override;

 private:
  // Penalty slots (ops/sampling.h): penalty_slots_ x penalty_vocab_ cells.
  int penalty_slots_ = 0, penalty_vocab_ = 0;
  std::vector<uint32_t> penalty_cells_;
  // bf16 emulation: rounds `t` if it lies in an activation buffer.
  void round_act(const Tensor& t) const;
  bool bf16_ = false;
  struct ActRange {
    size_t index;  // in scratch_
    const char *begin, *end;
  };
  std::vector<ActRange> act_ranges_;
  StepBatch batch_;
  std::vector<Tensor> scratch_;
};

}  // namespace moelora
