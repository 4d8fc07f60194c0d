// A Backend that runs every required op on a CpuBackend it owns (CpuBackend is final, so tests
// forward instead of deriving). Tests derive from it to change what a backend *declares* — the
// shape limits it enforces, whether it has an optional op — while the math stays the CPU's.
// Only the pure virtual ops are forwarded: the optional ones keep Backend's defaults unless a
// test overrides them.
#pragma once

#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"

namespace moelora::testutil {

class ForwardingCpuBackend : public Backend {
 public:
  Device device() const override { return cpu_.device(); }
  DType act_dtype() const override { return cpu_.act_dtype(); }
  Tensor upload(const Tensor& host, DType dtype) override { return cpu_.upload(host, dtype); }
  LinearWeight upload_linear(const StoredWeight& w) override { return cpu_.upload_linear(w); }
  ExpertWeights upload_experts(const std::vector<StoredWeight>& g, const std::vector<StoredWeight>& u,
                               const std::vector<StoredWeight>& d) override {
    return cpu_.upload_experts(g, u, d);
  }
  Tensor random_tensor(DType dt, const std::vector<int64_t>& shape, uint64_t seed, float scale) override {
    return cpu_.random_tensor(dt, shape, seed, scale);
  }
  KvLayer alloc_kv_layer(int pages, int page_size, int kv_heads, int kd, int vd) override {
    return cpu_.alloc_kv_layer(pages, page_size, kv_heads, kd, vd);
  }
  DType lora_dtype() const override { return cpu_.lora_dtype(); }
  LoraModuleTable alloc_lora_table(int slots, int in, int out) override { return cpu_.alloc_lora_table(slots, in, out); }
  MoeLoraTable alloc_moe_lora_table(int slots, int e, int h, int i) override {
    return cpu_.alloc_moe_lora_table(slots, e, h, i);
  }
  void set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) override {
    cpu_.set_lora_slot(t, slot, a, b, rank);
  }
  void set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) override { cpu_.set_moe_lora_slot(t, slot, s); }
  const StepBatch& begin_step(const StepBatch& b) override { return cpu_.begin_step(b); }
  Tensor alloc(int64_t rows, int64_t cols, DType dt) override { return cpu_.alloc(rows, cols, dt); }
  Tensor alloc_act(int64_t rows, int64_t cols) override { return cpu_.alloc_act(rows, cols); }
  size_t scratch_mark() override { return cpu_.scratch_mark(); }
  void scratch_release(size_t mark) override { cpu_.scratch_release(mark); }
  void embed(const Tensor& table, Tensor out) override { cpu_.embed(table, out); }
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) override { cpu_.rmsnorm(x, w, eps, out); }
  void linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* l, Tensor out) override {
    cpu_.linear(x, w, l, out);
  }
  void linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts, Tensor out) override {
    cpu_.linear_parts(x, w, parts, out);
  }
  LinearWeight fuse_linear_rows(const std::vector<const LinearWeight*>& parts) override {
    return cpu_.fuse_linear_rows(parts);
  }
  void rope(Tensor x, int heads, int stride, int off, const RopeTable& r) override { cpu_.rope(x, heads, stride, off, r); }
  void attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads, float scale,
                 Tensor out) override {
    cpu_.attention(q, k, v, kv, heads, scale, out);
  }
  void silu_mul(const Tensor& g, const Tensor& u, Tensor out) override { cpu_.silu_mul(g, u, out); }
  void add(const Tensor& x, Tensor inout) override { cpu_.add(x, inout); }
  void router_logits(const Tensor& x, const LinearWeight& g, Tensor out) override { cpu_.router_logits(x, g, out); }
  void topk_softmax(const Tensor& l, int k, bool renorm, Tensor ids, Tensor w) override {
    cpu_.topk_softmax(l, k, renorm, ids, w);
  }
  void topk_sigmoid_grouped(const Tensor& l, const Tensor& bias, int k, int ng, int tg, bool renorm, float scaling,
                            Tensor ids, Tensor w) override {
    cpu_.topk_sigmoid_grouped(l, bias, k, ng, tg, renorm, scaling, ids, w);
  }
  void moe(const Tensor& x, const Tensor& ids, const Tensor& w, const ExpertWeights& e, const MoeLoraTable* l,
           Tensor out) override {
    cpu_.moe(x, ids, w, e, l, out);
  }
  void gather_logit_rows(const Tensor& x, Tensor out) override { cpu_.gather_logit_rows(x, out); }
  void mla_split_kv(const Tensor& kv, const Tensor& kpe, int heads, int nope, int vd, Tensor k, Tensor v) override {
    cpu_.mla_split_kv(kv, kpe, heads, nope, vd, k, v);
  }
  Tensor to_host_f32(const Tensor& t) override { return cpu_.to_host_f32(t); }
  std::vector<SampleOutput> sample(const Tensor& logits, const std::vector<SampleRow>& rows) override {
    return cpu_.sample(logits, rows);
  }

 protected:
  CpuBackend cpu_;
};

}  // namespace moelora::testutil
