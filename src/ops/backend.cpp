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
