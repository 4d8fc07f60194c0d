#include "model/fused_projections.h"

namespace moelora {

namespace {

// Fuses `parts` into `fused` when the backend can; then drops the parts' storage unless kept.
void fuse(Backend& b, LinearWeight& fused, std::initializer_list<LinearWeight*> parts, bool keep_parts) {
  std::vector<const LinearWeight*> ps(parts.begin(), parts.end());
  for (const LinearWeight* p : ps)
    if (!p->defined()) return;
  fused = b.fuse_linear_rows(ps);
  if (!fused.defined() || keep_parts) return;
  for (LinearWeight* p : parts) {
    p->w = Tensor();
    p->scale_inv = Tensor();
    p->group_scale = Tensor();
    p->global_scale = Tensor();
  }
}

}  // namespace

void fuse_projections(ModelWeights& w, Backend& b, bool keep_parts) {
  for (LayerWeights& lw : w.layers) {
    AttentionWeights& a = lw.attn;
    if (a.q.defined() && a.k.defined() && a.v.defined()) fuse(b, a.qkv, {&a.q, &a.k, &a.v}, keep_parts);
    if (a.q_a.defined() && a.kv_a.defined()) fuse(b, a.q_a_kv_a, {&a.q_a, &a.kv_a}, keep_parts);
    if (!lw.is_moe) fuse(b, lw.mlp.gate_up, {&lw.mlp.gate, &lw.mlp.up}, keep_parts);
    if (lw.has_shared) fuse(b, lw.shared.gate_up, {&lw.shared.gate, &lw.shared.up}, keep_parts);
  }
}

}  // namespace moelora
