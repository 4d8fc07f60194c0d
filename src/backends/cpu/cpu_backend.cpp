#include "backends/cpu/cpu_backend.h"

#include <algorithm>
#include <cstring>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"

namespace moelora {

Tensor CpuBackend::upload(const Tensor& host, DType dtype) {
  MOELORA_CHECK_MSG(dtype == DType::kF32 || !is_float_dtype(host.dtype()), "CPU backend keeps floats as f32");
  if (is_float_dtype(host.dtype())) {
    Tensor f = to_f32(host);
    if (bf16_)
      for (int64_t i = 0; i < f.numel(); ++i) f.ptr<float>()[i] = bf16_to_f32(f32_to_bf16(f.ptr<float>()[i]));
    return f;
  }
  Tensor out = Tensor::empty_host(host.dtype(), host.shape());
  std::memcpy(out.data(), host.data(), host.nbytes());
  return out;
}

LinearWeight CpuBackend::upload_linear(const StoredWeight& w) {
  // The reference computes in f32 on dequantised weights, whatever the checkpoint's format.
  LinearWeight lw;
  lw.w = dequantize_to_f32(w);
  lw.out = w.out;
  lw.in = w.in;
  return lw;
}

ExpertWeights CpuBackend::upload_experts(const std::vector<StoredWeight>& gate, const std::vector<StoredWeight>& up,
                                         const std::vector<StoredWeight>& down) {
  ExpertWeights ew;
  ew.num_experts = static_cast<int>(gate.size());
  ew.intermediate = gate[0].out;
  ew.hidden = gate[0].in;
  const int E = ew.num_experts, H = ew.hidden, I = ew.intermediate;
  Tensor gu = Tensor::empty_host(DType::kF32, {static_cast<int64_t>(E) * 2 * I, H});
  Tensor dn = Tensor::empty_host(DType::kF32, {static_cast<int64_t>(E) * H, I});
  for (int e = 0; e < E; ++e) {
    Tensor g = dequantize_to_f32(gate[e]);
    Tensor u = dequantize_to_f32(up[e]);
    Tensor d = dequantize_to_f32(down[e]);
    float* dst = gu.ptr<float>() + static_cast<int64_t>(e) * 2 * I * H;
    std::memcpy(dst, g.data(), g.nbytes());
    std::memcpy(dst + static_cast<int64_t>(I) * H, u.data(), u.nbytes());
    std::memcpy(dn.ptr<float>() + static_cast<int64_t>(e) * H * I, d.data(), d.nbytes());
  }
  ew.gate_up.w = gu;
  ew.gate_up.out = 2 * I * E;
  ew.gate_up.in = H;
  ew.down.w = dn;
  ew.down.out = H * E;
  ew.down.in = I;
  return ew;
}

Tensor CpuBackend::random_tensor(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) {
  // The CPU backend keeps floats as f32 (FP8 as exact f32 values of random finite codes).
  Tensor t = Tensor::empty_host(DType::kF32, shape);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const uint32_t r = static_cast<uint32_t>(x >> 32);
    if (dtype == DType::kF8E4M3) {
      uint8_t code = static_cast<uint8_t>(r);
      if ((code & 0x7f) == 0x7f) code ^= 1;  // never NaN
      t.ptr<float>()[i] = fp8e4m3_to_f32(code);
    } else {
      t.ptr<float>()[i] = scale * (2.0f * static_cast<float>(r) / 4294967296.0f - 1.0f);
    }
  }
  return t;
}

KvLayer CpuBackend::alloc_kv_layer(int num_pages, int page_size, int kv_heads, int k_head_dim, int v_head_dim) {
  KvLayer kv;
  kv.page_size = page_size;
  kv.kv_heads = kv_heads;
  kv.k_head_dim = k_head_dim;
  kv.v_head_dim = v_head_dim;
  kv.k = Tensor::empty_host(DType::kF32, {num_pages, page_size, static_cast<int64_t>(kv_heads) * k_head_dim});
  kv.v = Tensor::empty_host(DType::kF32, {num_pages, page_size, static_cast<int64_t>(kv_heads) * v_head_dim});
  return kv;
}

LoraModuleTable CpuBackend::alloc_lora_table(int num_slots, int in, int out) {
  return make_lora_table(num_slots, in, out, [](DType dt, int64_t n) { return Tensor::empty_host(dt, {n}); });
}

MoeLoraTable CpuBackend::alloc_moe_lora_table(int num_slots, int num_experts, int hidden, int intermediate) {
  return make_moe_lora_table(num_slots, num_experts, hidden, intermediate, [](DType dt, int64_t n) { return Tensor::empty_host(dt, {n}); });
}

void CpuBackend::set_lora_slot(LoraModuleTable& t, int slot, const Tensor& a, const Tensor& b, int rank) {
  MOELORA_CHECK(slot >= 0 && slot < t.num_slots);
  t.a_ptrs.ptr<int64_t>()[slot] = rank ? reinterpret_cast<int64_t>(a.data()) : 0;
  t.b_ptrs.ptr<int64_t>()[slot] = rank ? reinterpret_cast<int64_t>(b.data()) : 0;
  t.ranks.ptr<int32_t>()[slot] = rank;
  t.host_rank[slot] = rank;
}

void CpuBackend::set_moe_lora_slot(MoeLoraTable& t, int slot, const MoeLoraSlot& s) {
  MOELORA_CHECK(slot >= 0 && slot < t.num_slots);
  auto put = [slot](Tensor& tab, int64_t v) { tab.ptr<int64_t>()[slot] = v; };
  put(t.gu_a, s.gu_rank ? reinterpret_cast<int64_t>(s.gu_a.data()) : 0);
  put(t.gu_b, s.gu_rank ? reinterpret_cast<int64_t>(s.gu_b.data()) : 0);
  put(t.gu_a_expert_stride, s.gu_a_stride);
  put(t.gu_b_expert_stride, s.gu_b_stride);
  put(t.d_a, s.d_rank ? reinterpret_cast<int64_t>(s.d_a.data()) : 0);
  put(t.d_b, s.d_rank ? reinterpret_cast<int64_t>(s.d_b.data()) : 0);
  put(t.d_a_expert_stride, s.d_a_stride);
  put(t.d_b_expert_stride, s.d_b_stride);
  t.gu_rank.ptr<int32_t>()[slot] = s.gu_rank;
  t.d_rank.ptr<int32_t>()[slot] = s.d_rank;
  t.host_gu_rank[slot] = s.gu_rank;
  t.host_d_rank[slot] = s.d_rank;
}

const StepBatch& CpuBackend::begin_step(const StepBatch& batch) {
  batch_ = batch;
  scratch_.clear();
  act_ranges_.clear();
  return batch_;
}

Tensor CpuBackend::alloc_act(int64_t rows, int64_t cols) {
  Tensor t = alloc(rows, cols, act_dtype());
  if (bf16_)
    act_ranges_.push_back({scratch_.size() - 1, static_cast<const char*>(t.data()),
                           static_cast<const char*>(t.data()) + t.nbytes()});
  return t;
}

void CpuBackend::round_act(const Tensor& t) const {
  if (!bf16_) return;
  const char* p = static_cast<const char*>(t.data());
  const bool act = std::any_of(act_ranges_.begin(), act_ranges_.end(),
                               [p](const ActRange& r) { return p >= r.begin && p < r.end; });
  if (!act) return;
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < t.cols(); ++c) {
      float& v = t.ptr<float>()[r * t.ld() + c];
      v = bf16_to_f32(f32_to_bf16(v));
    }
}

Tensor CpuBackend::alloc(int64_t rows, int64_t cols, DType dtype) {
  Tensor t = Tensor::empty_host(dtype, {rows, cols});
  scratch_.push_back(t);
  return t;
}

void CpuBackend::embed(const Tensor& table, Tensor out) {
  const int64_t H = table.dim(1);
  MOELORA_CHECK(out.cols() == H && out.rows() == batch_.num_tokens());
  for (int t = 0; t < batch_.num_tokens(); ++t) {
    const int id = batch_.token_ids[t];
    MOELORA_CHECK_MSG(id >= 0 && id < table.dim(0), "token id {} outside the vocabulary", id);
    std::memcpy(out.ptr<float>() + t * out.ld(), table.ptr<float>() + id * H, H * sizeof(float));
  }
  round_act(out);
}

void CpuBackend::rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor out) {
  cpu::rmsnorm(x.ptr<float>(), x.ld(), x.rows(), static_cast<int>(x.cols()), w.ptr<float>(),
               static_cast<int>(w.numel()), eps, out.ptr<float>(), out.ld());
  round_act(out);
}

void CpuBackend::linear(const Tensor& x, const LinearWeight& w, const LoraModuleTable* lora, Tensor out) {
  MOELORA_CHECK_MSG(x.cols() == w.in && out.cols() == w.out && x.rows() == out.rows(),
                    "linear: x {} W [{}, {}] out {}", x.shape_string(), w.out, w.in, out.shape_string());
  cpu::linear(x.ptr<float>(), x.ld(), x.rows(), w.w.ptr<float>(), w.out, w.in, out.ptr<float>(), out.ld());
  if (lora != nullptr) {
    MOELORA_CHECK(x.rows() == batch_.num_tokens());
    cpu::lora_add(x.ptr<float>(), x.ld(), x.rows(), batch_.token_slot.data(), *lora, out.ptr<float>(), out.ld());
  }
  round_act(out);
}

void CpuBackend::linear_parts(const Tensor& x, const LinearWeight& w, const std::vector<LinearPart>& parts,
                              Tensor out) {
  MOELORA_CHECK_MSG(x.cols() == w.in && out.cols() == w.out && x.rows() == out.rows(),
                    "linear_parts: x {} W [{}, {}] out {}", x.shape_string(), w.out, w.in, out.shape_string());
  cpu::linear(x.ptr<float>(), x.ld(), x.rows(), w.w.ptr<float>(), w.out, w.in, out.ptr<float>(), out.ld());
  for (const LinearPart& p : parts) {
    MOELORA_CHECK_MSG(p.begin >= 0 && p.out > 0 && p.begin + p.out <= w.out, "linear_parts: part [{}, +{}) of {}",
                      p.begin, p.out, w.out);
    if (p.lora == nullptr) continue;
    MOELORA_CHECK(x.rows() == batch_.num_tokens() && p.lora->out == p.out && p.lora->in == w.in);
    Tensor y = out.slice_cols(p.begin, p.out);
    cpu::lora_add(x.ptr<float>(), x.ld(), x.rows(), batch_.token_slot.data(), *p.lora, y.ptr<float>(), y.ld());
  }
  round_act(out);
}

// Weights here are float32 [out, in] (upload_linear dequantises every format): rows concatenate.
LinearWeight CpuBackend::fuse_linear_rows(const std::vector<const LinearWeight*>& parts) {
  if (fused_split_rows(parts, /*block_scaled=*/false) < 0) return {};
  int64_t rows = 0;
  for (const LinearWeight* p : parts) {
    if (p->w.dtype() != DType::kF32 || !p->w.contiguous() || p->scale_inv.defined()) return {};
    rows += p->out;
  }
  LinearWeight f = *parts[0];
  f.out = static_cast<int>(rows);
  f.split_rows = 0;
  f.w = Tensor::empty_host(DType::kF32, {rows, f.in});
  float* dst = f.w.ptr<float>();
  for (const LinearWeight* p : parts) {
    const size_t n = static_cast<size_t>(p->out) * p->in;
    std::memcpy(dst, p->w.ptr<float>(), n * sizeof(float));
    dst += n;
  }
  return f;
}

void CpuBackend::rope(Tensor x, int heads, int head_stride, int rot_offset, const RopeTable& rope) {
  cpu::rope(x.ptr<float>(), x.ld(), x.rows(), batch_.positions.data(), heads, head_stride, rot_offset, rope);
  round_act(x);
}

void CpuBackend::attention(const Tensor& q, const Tensor& k, const Tensor& v, KvLayer& kv, int heads,
                           float scale, Tensor out) {
  cpu::AttentionArgs a{q.ptr<float>(), q.ld(), k.ptr<float>(), k.ld(), v.ptr<float>(), v.ld(),
                       out.ptr<float>(), out.ld(), q.rows(), heads, scale, batch_.positions.data(),
                       batch_.token_seq.data(), &batch_};
  cpu::attention(a, kv);
  round_act(out);
}

void CpuBackend::silu_mul(const Tensor& gate, const Tensor& up, Tensor out) {
  cpu::silu_mul(gate.ptr<float>(), gate.ld(), up.ptr<float>(), up.ld(), gate.rows(),
                static_cast<int>(gate.cols()), out.ptr<float>(), out.ld());
  round_act(out);
}

void CpuBackend::add(const Tensor& x, Tensor inout) {
  MOELORA_CHECK(x.rows() == inout.rows() && x.cols() == inout.cols());
  for (int64_t r = 0; r < x.rows(); ++r)
    for (int64_t c = 0; c < x.cols(); ++c) inout.ptr<float>()[r * inout.ld() + c] += x.ptr<float>()[r * x.ld() + c];
  round_act(inout);
}

void CpuBackend::router_logits(const Tensor& x, const LinearWeight& gate, Tensor out) {
  cpu::linear(x.ptr<float>(), x.ld(), x.rows(), gate.w.ptr<float>(), gate.out, gate.in, out.ptr<float>(),
              out.ld());
}

void CpuBackend::topk_softmax(const Tensor& logits, int k, bool renormalize, Tensor ids, Tensor weights) {
  cpu::topk_softmax(logits.ptr<float>(), logits.rows(), static_cast<int>(logits.cols()), k, renormalize,
                    ids.ptr<int32_t>(), weights.ptr<float>());
}

void CpuBackend::topk_sigmoid_grouped(const Tensor& logits, const Tensor& bias, int k, int n_group,
                                      int topk_group, bool renormalize, float scaling, Tensor ids,
                                      Tensor weights) {
  cpu::topk_sigmoid_grouped(logits.ptr<float>(), bias.ptr<float>(), logits.rows(),
                            static_cast<int>(logits.cols()), k, n_group, topk_group, renormalize, scaling,
                            ids.ptr<int32_t>(), weights.ptr<float>());
}

void CpuBackend::moe(const Tensor& x, const Tensor& ids, const Tensor& weights, const ExpertWeights& experts,
                     const MoeLoraTable* lora, Tensor out) {
  cpu::MoeArgs a;
  a.x = x.ptr<float>();
  a.ldx = x.ld();
  a.T = x.rows();
  a.k = static_cast<int>(ids.cols());
  a.ids = ids.ptr<int32_t>();
  a.weights = weights.ptr<float>();
  a.slot = batch_.token_slot.data();
  a.w_gate_up = experts.gate_up.w.ptr<float>();
  a.w_down = experts.down.w.ptr<float>();
  a.E = experts.num_experts;
  a.H = experts.hidden;
  a.I = experts.intermediate;
  a.lora = lora;
  a.out = out.ptr<float>();
  a.ldo = out.ld();
  cpu::moe(a);
  round_act(out);
}

void CpuBackend::gather_logit_rows(const Tensor& x, Tensor out) {
  for (size_t r = 0; r < batch_.logit_rows.size(); ++r)
    std::memcpy(out.ptr<float>() + r * out.ld(), x.ptr<float>() + batch_.logit_rows[r] * x.ld(),
                x.cols() * sizeof(float));
}

void CpuBackend::mla_split_kv(const Tensor& kv, const Tensor& k_pe, int heads, int nope, int v_dim, Tensor k,
                              Tensor v) {
  const int rope = static_cast<int>(k_pe.cols());
  for (int64_t t = 0; t < kv.rows(); ++t) {
    const float* src = kv.ptr<float>() + t * kv.ld();
    const float* pe = k_pe.ptr<float>() + t * k_pe.ld();
    for (int h = 0; h < heads; ++h) {
      float* kd = k.ptr<float>() + t * k.ld() + static_cast<int64_t>(h) * (nope + rope);
      std::memcpy(kd, src + static_cast<int64_t>(h) * (nope + v_dim), nope * sizeof(float));
      std::memcpy(kd + nope, pe, rope * sizeof(float));
      std::memcpy(v.ptr<float>() + t * v.ld() + static_cast<int64_t>(h) * v_dim,
                  src + static_cast<int64_t>(h) * (nope + v_dim) + nope, v_dim * sizeof(float));
    }
  }
  round_act(k);
  round_act(v);
}

void CpuBackend::mla_attention_absorbed(const Tensor& q, const Tensor& latent, const Tensor& k_pe,
                                        const LinearWeight& kv_b, const LoraModuleTable* kv_b_lora, KvLayer& kv,
                                        int heads, int nope, int v_dim, float scale, Tensor out) {
  const int R = static_cast<int>(latent.cols()), rope = static_cast<int>(k_pe.cols());
  const int64_t T = q.rows();
  check_mla_absorbed_shapes(batch_.num_tokens(), q, latent, k_pe, kv_b, kv_b_lora, kv, heads, nope, v_dim, out);
  // The CPU backend holds every weight as float32 (FP8 dequantised at upload, as for linear).
  MOELORA_CHECK_MSG(kv_b.w.dtype() == DType::kF32 && kv_b.w.contiguous(), "absorbed MLA: kv_b of {}",
                    dtype_name(kv_b.w.dtype()));
  cpu::MlaAbsorbedArgs a{q.ptr<float>(), q.ld(), latent.ptr<float>(), latent.ld(), k_pe.ptr<float>(), k_pe.ld(),
                         kv_b.w.ptr<float>(), kv_b_lora, out.ptr<float>(), out.ld(), T, heads, nope, rope, v_dim, R,
                         scale, batch_.positions.data(), batch_.token_seq.data(), batch_.token_slot.data(), &batch_};
  cpu::mla_attention_absorbed(a, kv);
  round_act(out);
}

std::vector<SampleOutput> CpuBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows) {
  MOELORA_CHECK(logits.dtype() == DType::kF32 && logits.rows() == static_cast<int64_t>(rows.size()));
  const int V = static_cast<int>(logits.cols());
  check_sample_rows(rows, V, penalty_slots_, penalty_vocab_);
  bool slots = false;
  for (const SampleRow& r : rows) slots = slots || r.penalty_slot >= 0;
  if (!slots) return cpu::sample(logits.ptr<float>(), logits.ld(), V, rows);
  // Rows with a penalty slot sample with their slot's counts as edits (the contract's definition),
  // then count the drawn token into the slot.
  std::vector<SampleRow> expanded(rows);
  for (SampleRow& r : expanded) {
    if (r.penalty_slot < 0) continue;
    r.edits = penalty_slot_edits(r, penalty_cells_.data() + static_cast<size_t>(r.penalty_slot) * V, V);
  }
  std::vector<SampleOutput> out = cpu::sample(logits.ptr<float>(), logits.ld(), V, expanded);
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].penalty_slot >= 0) {
      uint32_t& cell = penalty_cells_[static_cast<size_t>(rows[i].penalty_slot) * V + out[i].token];
      cell = penalty_count(cell, /*generated=*/true);
    }
  return out;
}

void CpuBackend::reserve_penalty_slots(int n, int vocab) {
  MOELORA_CHECK(n >= 0 && vocab > 0);
  penalty_slots_ = n;
  penalty_vocab_ = vocab;
  penalty_cells_.assign(static_cast<size_t>(n) * vocab, 0u);
}

void CpuBackend::penalty_reset(int slot, const std::vector<int32_t>& tokens, int prompt_len) {
  MOELORA_CHECK_MSG(slot >= 0 && slot < penalty_slots_, "penalty slot {} of {}", slot, penalty_slots_);
  for (int32_t t : tokens) MOELORA_CHECK_MSG(t >= 0 && t < penalty_vocab_, "token {} outside the vocabulary", t);
  penalty_reset_cells(penalty_cells_.data() + static_cast<size_t>(slot) * penalty_vocab_, penalty_vocab_, tokens,
                      prompt_len);
}

Tensor CpuBackend::to_host_f32(const Tensor& t) {
  Tensor out = Tensor::empty_host(DType::kF32, {t.rows(), t.cols()});
  for (int64_t r = 0; r < t.rows(); ++r)
    std::memcpy(out.ptr<float>() + r * t.cols(), t.ptr<float>() + r * t.ld(), t.cols() * sizeof(float));
  return out;
}

}  // namespace moelora
