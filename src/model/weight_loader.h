// Reads a checkpoint's tensors by their Hugging Face names, checks every shape and dtype against
// the config, and hands them to a backend (which keeps FP8 as FP8 or dequantises, as it likes).
#pragma once

#include "core/status.h"
#include "io/checkpoint.h"
#include "model/model_config.h"
#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

// Checks every tensor, then refuses weights that need more than the device's free memory
// (Backend::device_memory) before uploading any of them. `derived_bytes`: what the backend will
// derive from them on first use (Backend::derived_weight_bytes), counted in the same check.
Result<ModelWeights> load_model_weights(const Checkpoint& ck, const ModelConfig& cfg, Backend& backend,
                                        size_t derived_bytes = 0);
// The bytes `backend` will hold for the checkpoint's weights (every tensor checked, nothing uploaded).
Result<size_t> device_weight_bytes(const Checkpoint& ck, const ModelConfig& cfg, Backend& backend);

}  // namespace moelora
