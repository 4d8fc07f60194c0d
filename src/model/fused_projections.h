// Projections that read the same input, fused row-wise into one weight after loading, so that a
// step runs one GEMM for them (Backend::linear_parts) instead of one per projection: q|k|v of GQA
// attention, q_a|kv_a of MLA, gate|up of dense MLPs and of shared experts. Each part keeps its own LoRA table on its
// own columns, so adapters are unaffected. A backend that does not fuse (Backend::fuse_linear_rows
// answers an undefined weight), or parts whose FP8 scale blocks would mix (fused_split_rows), stay
// separate; the forward pass (forward_pass.cpp) takes whichever form is there.
#pragma once

#include "model/model_weights.h"
#include "ops/backend.h"

namespace moelora {

// keep_parts: the separate weights stay as well (the CPU reference's sharded forward cuts them per
// rank, then fuses each rank's own); otherwise their memory is given back and only their shapes
// remain.
void fuse_projections(ModelWeights& w, Backend& backend, bool keep_parts);

}  // namespace moelora
