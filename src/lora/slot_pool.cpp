#include "lora/slot_pool.h"

#include "model/archs.h"

namespace moelora {

LoraSlotPool::LoraSlotPool(const ModelConfig& cfg, Backend& backend, int num_slots)
    : cfg_(cfg), backend_(backend), slots_(num_slots) {
  dense_.resize(cfg.num_layers);
  experts_.resize(cfg.num_layers);
  tables_.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l) {
    dense_[l].resize(kNumLoraTargets);
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      auto [in, out] = lora_target_shape(cfg, l, target);
      if (in == 0) continue;  // this layer has no such projection
      dense_[l][t] = std::make_unique<LoraModuleTable>(backend.alloc_lora_table(num_slots, in, out));
      tables_[l].dense[t] = dense_[l][t].get();
    }
    if (cfg.layer_is_moe[l]) {
      experts_[l] = std::make_unique<MoeLoraTable>(
          backend.alloc_moe_lora_table(num_slots, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size));
      tables_[l].experts = experts_[l].get();
    }
  }
}

int LoraSlotPool::slot_of(const LoraAdapter* adapter) const {
  for (int s = 0; s < num_slots(); ++s)
    if (slots_[s].adapter.get() == adapter) return s;
  return -1;
}

bool LoraSlotPool::can_acquire(const LoraAdapter* adapter) const {
  if (slot_of(adapter) >= 0) return true;
  for (const Slot& s : slots_)
    if (s.refs == 0) return true;
  return false;
}

Result<int> LoraSlotPool::acquire(const std::shared_ptr<const LoraAdapter>& adapter) {
  int slot = slot_of(adapter.get());
  if (slot < 0) {
    // Prefer an empty slot, else the least recently used unreferenced one.
    for (int s = 0; s < num_slots(); ++s) {
      if (slots_[s].refs != 0) continue;
      if (slot < 0 || (slots_[s].adapter == nullptr && slots_[slot].adapter != nullptr) ||
          ((slots_[s].adapter == nullptr) == (slots_[slot].adapter == nullptr) &&
           slots_[s].last_use < slots_[slot].last_use))
        slot = s;
    }
    if (slot < 0)
      return make_error(ErrorCode::kResourceExhausted, "all {} adapter slots are in use", num_slots());
    place(slot, adapter);
  }
  slots_[slot].refs++;
  slots_[slot].last_use = ++clock_;
  return slot;
}

void LoraSlotPool::release(int slot) {
  MOELORA_CHECK(slot >= 0 && slot < num_slots() && slots_[slot].refs > 0);
  slots_[slot].refs--;
}

void LoraSlotPool::evict(const LoraAdapter* adapter) {
  const int slot = slot_of(adapter);
  if (slot < 0) return;
  MOELORA_CHECK_MSG(slots_[slot].refs == 0, "evicting adapter '{}' while requests use it", adapter->name);
  clear(slot);
}

int LoraSlotPool::used_slots() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.refs > 0;
  return n;
}

int LoraSlotPool::resident_slots() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.adapter != nullptr;
  return n;
}

void LoraSlotPool::clear(int slot) {
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (auto& t : dense_[l])
      if (t) backend_.set_lora_slot(*t, slot, Tensor(), Tensor(), 0);
    if (experts_[l]) backend_.set_moe_lora_slot(*experts_[l], slot, {});
  }
  slots_[slot].adapter.reset();
  slots_[slot].uploaded.clear();
}

void LoraSlotPool::place(int slot, const std::shared_ptr<const LoraAdapter>& adapter) {
  clear(slot);
  Slot& s = slots_[slot];
  const DType dt = backend_.lora_dtype();
  auto up = [&](const Tensor& host) {
    Tensor t = backend_.upload(host, dt);
    s.uploaded.push_back(t);
    return t;
  };
  for (int l = 0; l < cfg_.num_layers; ++l) {
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const LoraFactor& f = adapter->dense[l][t];
      if (f.rank == 0) continue;
      MOELORA_CHECK_MSG(dense_[l][t] != nullptr, "adapter '{}' targets a projection the model lacks", adapter->name);
      backend_.set_lora_slot(*dense_[l][t], slot, up(f.a), up(f.b), f.rank);
    }
    const ExpertLora& x = adapter->experts[l];
    if (!x.any()) continue;
    MOELORA_CHECK(experts_[l] != nullptr);
    Backend::MoeLoraSlot ms;
    const int64_t H = cfg_.hidden_size, I = cfg_.moe_intermediate_size;
    if (x.gu_rank > 0) {
      ms.gu_a = up(x.gu_a);
      ms.gu_b = up(x.gu_b);
      ms.gu_rank = x.gu_rank;
      ms.gu_a_stride = x.gu_a.dim(0) == 1 ? 0 : x.gu_rank * H;
      ms.gu_b_stride = 2 * I * x.gu_rank;
    }
    if (x.d_rank > 0) {
      ms.d_a = up(x.d_a);
      ms.d_b = up(x.d_b);
      ms.d_rank = x.d_rank;
      ms.d_a_stride = x.d_rank * I;
      ms.d_b_stride = x.d_b.dim(0) == 1 ? 0 : H * x.d_rank;
    }
    backend_.set_moe_lora_slot(*experts_[l], slot, ms);
  }
  s.adapter = adapter;
}

}  // namespace moelora
