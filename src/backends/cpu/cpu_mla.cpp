// CPU reference: DeepSeek MLA attention in the absorbed form (the KV cache holds the latent).
// Every sum is a float64 accumulation, and the absorbed query qc and latent output o stay in
// float64 between their stages: the only float32 roundings are the cache (c and k_pe, which are
// float32 activations already) and the output, so the result differs from the decompressed path
// only by that path's float32 storage of k_nope and v (docs/numerics.md).
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"

namespace moelora::cpu {

namespace {
// The token's kv_b LoRA factors (rank 0: none). A [r, R], B [heads * (nope + v_dim), r].
struct Factors {
  const float* A = nullptr;
  const float* B = nullptr;
  int r = 0;
};

Factors factors_of(const LoraModuleTable* t, int slot) {
  if (t == nullptr || slot < 0) return {};
  MOELORA_CHECK_MSG(slot < t->num_slots, "token slot {} outside {} slots", slot, t->num_slots);
  const int r = t->ranks.ptr<int32_t>()[slot];
  if (r == 0) return {};
  return {reinterpret_cast<const float*>(t->a_ptrs.ptr<int64_t>()[slot]),
          reinterpret_cast<const float*>(t->b_ptrs.ptr<int64_t>()[slot]), r};
}
}  // namespace

void mla_attention_absorbed(const MlaAbsorbedArgs& a, KvLayer& kv) {
  const int R = a.R, rope = a.rope, nope = a.nope, vd = a.v_dim, width = R + rope, F = nope + vd;
  MOELORA_CHECK_MSG(kv.kv_heads == 1 && kv.k_head_dim == width && kv.v_head_dim == 0,
                    "absorbed MLA needs the latent cache (1 head of {} values, no V), got {} heads of {} / {}", width,
                    kv.kv_heads, kv.k_head_dim, kv.v_head_dim);
  if (a.lora != nullptr)
    MOELORA_CHECK_MSG(a.lora->in == R && a.lora->out == a.heads * F, "kv_b LoRA table [{} -> {}], want [{} -> {}]",
                      a.lora->in, a.lora->out, R, a.heads * F);
  float* cache = kv.k.ptr<float>();
  // 1. Every token of the step enters the cache first, so a prefill chunk sees itself.
  for (int64_t t = 0; t < a.T; ++t) {
    float* row = cache + cache_row(*a.batch, a.token_seq[t], a.positions[t], kv.page_size) * width;
    std::copy_n(a.latent + t * a.ldc, R, row);
    std::copy_n(a.k_pe + t * a.ldpe, rope, row + R);
  }
  // 2. Causal attention over the token's own sequence, per head in the latent space.
  std::vector<const float*> rows;
  std::vector<double> p, qc(R), o(R), u, ua;
  for (int64_t t = 0; t < a.T; ++t) {
    const int seq = a.token_seq[t], n = a.positions[t] + 1;
    rows.resize(n);
    p.resize(n);
    for (int j = 0; j < n; ++j) rows[j] = cache + cache_row(*a.batch, seq, j, kv.page_size) * width;
    const Factors f = factors_of(a.lora, a.slot[t]);
    u.assign(f.r, 0.0);
    ua.assign(f.r, 0.0);
    for (int h = 0; h < a.heads; ++h) {
      const float* qn = a.q + t * a.ldq + static_cast<int64_t>(h) * (nope + rope);
      const float* qpe = qn + nope;
      const int64_t uk = static_cast<int64_t>(h) * F, uv = uk + nope;  // first k_nope / v row of head h
      // qc = W_UK_h^T q_nope + A^T (B_UK_h^T q_nope)
      std::fill(qc.begin(), qc.end(), 0.0);
      for (int d = 0; d < nope; ++d) {
        const float* wr = a.w_kv_b + (uk + d) * R;
        const double qd = qn[d];
        for (int i = 0; i < R; ++i) qc[i] += qd * wr[i];
      }
      if (f.r > 0) {
        for (int k = 0; k < f.r; ++k) {
          double acc = 0.0;
          for (int d = 0; d < nope; ++d) acc += static_cast<double>(qn[d]) * f.B[(uk + d) * f.r + k];
          u[k] = acc;
        }
        for (int k = 0; k < f.r; ++k) {
          const float* ar = f.A + static_cast<int64_t>(k) * R;
          for (int i = 0; i < R; ++i) qc[i] += u[k] * ar[i];
        }
      }
      for (int j = 0; j < n; ++j) {
        double dot = 0.0;
        for (int i = 0; i < R; ++i) dot += qc[i] * rows[j][i];
        for (int d = 0; d < rope; ++d) dot += static_cast<double>(qpe[d]) * rows[j][R + d];
        p[j] = dot * a.scale;
      }
      softmax_weights(p.data(), n);
      std::fill(o.begin(), o.end(), 0.0);
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < R; ++i) o[i] += p[j] * rows[j][i];
      // out_h = W_UV_h o + B_UV_h (A o)
      for (int k = 0; k < f.r; ++k) {
        const float* ar = f.A + static_cast<int64_t>(k) * R;
        double acc = 0.0;
        for (int i = 0; i < R; ++i) acc += o[i] * ar[i];
        ua[k] = acc;
      }
      float* out = a.out + t * a.ldo + static_cast<int64_t>(h) * vd;
      for (int e = 0; e < vd; ++e) {
        const float* wr = a.w_kv_b + (uv + e) * R;
        double acc = 0.0;
        for (int i = 0; i < R; ++i) acc += o[i] * wr[i];
        for (int k = 0; k < f.r; ++k) acc += ua[k] * f.B[(uv + e) * f.r + k];
        out[e] = static_cast<float>(acc);
      }
    }
  }
}

}  // namespace moelora::cpu
