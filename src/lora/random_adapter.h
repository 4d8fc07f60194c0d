// An adapter with pseudo-random factors for a model's shapes, made in memory (serving benchmarks
// at full size, where writing and re-reading gigabytes of PEFT files would measure the disk).
// Every LoRA target of every layer gets rank `rank`, routed experts included (per-expert factors),
// with values uniform in [-scale, scale].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lora/adapter.h"
#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

std::shared_ptr<const LoraAdapter> make_random_adapter(const ModelConfig& cfg, const std::string& name, int rank,
                                                       uint64_t seed, float scale = 0.01f);

// Pseudo-random LoRA factors made on the backend straight into its slot tables, `slots` slots of
// rank `rank` on every dense projection and the routed experts of every layer (benchmarks of the
// kernels at full size: no host copy, no slot pool). `tables` points into the other members.
struct DeviceRandomAdapters {
  std::vector<std::unique_ptr<LoraModuleTable>> dense;
  std::vector<std::unique_ptr<MoeLoraTable>> experts;
  std::vector<Tensor> keep;  // the factors the tables point to
  LoraTables tables;
};
DeviceRandomAdapters make_device_random_adapters(const ModelConfig& cfg, Backend& backend, int slots, int rank,
                                                 uint64_t seed = 1000, float scale = 0.01f);

}  // namespace moelora
