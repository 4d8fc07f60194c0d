// The default adapter placement (Backend::begin_lora_placement): for backends whose memory is the
// host's (CpuBackend and the test backends built on it) a placement is a conversion and a copy.
#include "ops/backend.h"

namespace moelora {

int fused_split_rows(const std::vector<const LinearWeight*>& parts, bool block_scaled) {
  if (parts.size() < 2) return -1;
  const LinearWeight& first = *parts[0];
  int row = 0, split = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearWeight& p = *parts[i];
    if (!p.defined() || p.in != first.in || p.split_rows > 0) return -1;
    if (block_scaled && (p.block_out != first.block_out || p.block_in != first.block_in)) return -1;
    row += p.out;
    const bool last_boundary = i + 2 == parts.size();
    if (i + 1 < parts.size() && block_scaled && row % first.block_out != 0) {
      if (!last_boundary) return -1;  // a scale block would hold rows of two parts
      split = row;
    }
  }
  return split;
}

void Backend::linear_parts(const Tensor&, const LinearWeight&, const std::vector<LinearPart>&, Tensor) {
  MOELORA_CHECK_MSG(false, "the {} backend fuses no projections: linear_parts without fuse_linear_rows", name());
}

LinearWeight Backend::fuse_linear_rows(const std::vector<const LinearWeight*>&) { return {}; }

void check_sample_rows(const std::vector<SampleRow>& rows, int vocab, int penalty_slots, int penalty_vocab) {
  std::vector<char> taken(penalty_slots > 0 ? penalty_slots : 0, 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const SampleRow& row = rows[r];
    MOELORA_CHECK_MSG(row.logprobs >= 0 && row.logprobs <= kMaxTopLogprobs, "sample row {}: logprobs {} (0 to {})", r,
                      row.logprobs, kMaxTopLogprobs);
    for (size_t i = 0; i < row.edits.size(); ++i) {
      const int32_t t = row.edits[i].token;
      MOELORA_CHECK_MSG(t >= 0 && t < vocab && (i == 0 || row.edits[i - 1].token < t),
                        "sample row {}: edit {} is token {}; edits are sorted by token, one per token, below {}", r, i, t,
                        vocab);
    }
    const int s = row.penalty_slot;
    if (s < 0) continue;
    MOELORA_CHECK_MSG(s < penalty_slots && vocab == penalty_vocab, "sample row {}: penalty slot {} of {} (vocab {} vs {})",
                      r, s, penalty_slots, vocab, penalty_vocab);
    MOELORA_CHECK_MSG(!taken[s], "sample rows share penalty slot {}", s);
    taken[s] = 1;
  }
}

void check_mla_absorbed_shapes(int step_tokens, const Tensor& q, const Tensor& latent, const Tensor& k_pe,
                               const LinearWeight& kv_b, const LoraModuleTable* kv_b_lora, const KvLayer& kv,
                               int heads, int nope, int v_dim, const Tensor& out) {
  const int64_t T = q.rows(), R = latent.cols(), rope = k_pe.cols();
  MOELORA_CHECK_MSG(T == step_tokens && latent.rows() == T && k_pe.rows() == T && out.rows() == T,
                    "absorbed MLA: {} tokens in the step, q {} latent {} k_pe {} out {}", step_tokens,
                    q.shape_string(), latent.shape_string(), k_pe.shape_string(), out.shape_string());
  MOELORA_CHECK_MSG(q.cols() == int64_t{heads} * (nope + rope) && out.cols() == int64_t{heads} * v_dim,
                    "absorbed MLA: q {} / out {} for {} heads of nope {}, rope {}, v {}", q.shape_string(),
                    out.shape_string(), heads, nope, rope, v_dim);
  MOELORA_CHECK_MSG(kv_b.in == R && kv_b.out == heads * (nope + v_dim),
                    "absorbed MLA: kv_b [{}, {}] for {} heads x ({} + {}) rows of {} latent values", kv_b.out, kv_b.in,
                    heads, nope, v_dim, R);
  MOELORA_CHECK_MSG(kv.kv_heads == 1 && kv.k_head_dim == R + rope && kv.v_head_dim == 0,
                    "absorbed MLA needs the latent cache (1 head of {} values, no V), got {} heads of {} / {}", R + rope,
                    kv.kv_heads, kv.k_head_dim, kv.v_head_dim);
  if (kv_b_lora)
    MOELORA_CHECK_MSG(kv_b_lora->in == R && kv_b_lora->out == kv_b.out, "kv_b LoRA table [{} -> {}], want [{} -> {}]",
                      kv_b_lora->in, kv_b_lora->out, R, kv_b.out);
}

namespace {

// Factors are copied on the placement worker with Backend::upload; the table entries (host memory,
// read by the CPU ops) are recorded and written in commit() on the engine thread, so the worker
// never writes memory that a running step reads.
class HostLoraPlacement final : public LoraPlacement {
 public:
  HostLoraPlacement(Backend& backend, int slot) : backend_(backend), slot_(slot) {}

  Result<Tensor> upload(const Tensor& host) override { return backend_.upload(host, backend_.lora_dtype()); }
  void set_lora(LoraModuleTable& t, const Tensor& a, const Tensor& b, int rank) override {
    dense_.push_back({&t, a, b, rank});
  }
  void set_moe_lora(MoeLoraTable& t, const Backend::MoeLoraSlot& s) override { experts_.push_back({&t, s}); }
  Status finish() override { return {}; }
  bool ready() override { return true; }
  void commit() override {
    for (const Dense& d : dense_) backend_.set_lora_slot(*d.table, slot_, d.a, d.b, d.rank);
    for (const Experts& e : experts_) backend_.set_moe_lora_slot(*e.table, slot_, e.factors);
  }

 private:
  struct Dense {
    LoraModuleTable* table;
    Tensor a, b;  // owned here: the copies the slot serves
    int rank;
  };
  struct Experts {
    MoeLoraTable* table;
    Backend::MoeLoraSlot factors;
  };
  Backend& backend_;
  const int slot_;
  std::vector<Dense> dense_;
  std::vector<Experts> experts_;
};

}  // namespace

std::unique_ptr<LoraPlacement> Backend::begin_lora_placement(int slot, size_t /*bytes*/) {
  return std::make_unique<HostLoraPlacement>(*this, slot);
}

}  // namespace moelora
