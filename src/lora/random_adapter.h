// An adapter with pseudo-random factors for a model's shapes, made in memory (serving benchmarks
// at full size, where writing and re-reading gigabytes of PEFT files would measure the disk).
// Every LoRA target of every layer gets rank `rank`, routed experts included (per-expert factors),
// with values uniform in [-scale, scale].
#pragma once

#include <memory>
#include <string>

#include "lora/adapter.h"

namespace moelora {

std::shared_ptr<const LoraAdapter> make_random_adapter(const ModelConfig& cfg, const std::string& name, int rank,
                                                       uint64_t seed, float scale = 0.01f);

}  // namespace moelora
