// CPU reference: expert routing and the routed-expert MLP with per-token LoRA.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"
#include "core/dtype.h"

namespace moelora::cpu {

namespace {

// Indices of the k largest values, largest first; equal values keep the lower index first.
void top_k_indices(const double* v, int n, int k, int* out) {
  std::vector<int> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
    return v[a] != v[b] ? v[a] > v[b] : a < b;
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

}  // namespace

void topk_softmax(const float* logits, int64_t T, int E, int k, bool renormalize, int32_t* ids, float* w) {
  MOELORA_CHECK(k >= 1 && k <= E);
  std::vector<double> p(E);
  std::vector<int> top(k);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    double mx = -INFINITY;
    for (int e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    top_k_indices(p.data(), E, k, top.data());
    double top_sum = 0.0;
    for (int j = 0; j < k; ++j) top_sum += p[top[j]];
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = top[j];
      w[t * k + j] = static_cast<float>(renormalize ? p[top[j]] / top_sum : p[top[j]]);
    }
  }
}

void topk_sigmoid_grouped(const float* logits, const float* bias, int64_t T, int E, int k, int n_group,
                          int topk_group, bool renormalize, float scaling, int32_t* ids, float* w) {
  MOELORA_CHECK(E % n_group == 0 && topk_group <= n_group && k <= E);
  const int per_group = E / n_group;
  std::vector<double> score(E), choice(E), group_score(n_group);
  std::vector<int> top(k), top_groups(topk_group);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t * E + e])));
      choice[e] = score[e] + bias[e];
    }
    // A group's score is the sum of its two best choice values (its best alone if it has one).
    for (int g = 0; g < n_group; ++g) {
      const double* c = choice.data() + g * per_group;
      int pair[2];
      const int m = std::min(2, per_group);
      top_k_indices(c, per_group, m, pair);
      group_score[g] = 0.0;
      for (int i = 0; i < m; ++i) group_score[g] += c[pair[i]];
    }
    top_k_indices(group_score.data(), n_group, topk_group, top_groups.data());
    std::vector<bool> keep(n_group, false);
    for (int g : top_groups) keep[g] = true;
    // transformers masks dropped groups with 0.0 (not -inf); reproduce it exactly.
    for (int e = 0; e < E; ++e)
      if (!keep[e / per_group]) choice[e] = 0.0;
    top_k_indices(choice.data(), E, k, top.data());
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += score[top[j]];
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = top[j];
      double v = score[top[j]];
      if (renormalize) v /= (sum + 1e-20);
      w[t * k + j] = static_cast<float>(v * scaling);
    }
  }
}

namespace {

struct ExpertLora {
  const float* a = nullptr;  // [r, in]
  const float* b = nullptr;  // [out, r]
  int r = 0;
};

ExpertLora lookup(const Tensor& a, const Tensor& as, const Tensor& b, const Tensor& bs, const Tensor& rank,
                  int slot, int expert) {
  ExpertLora l;
  l.r = rank.ptr<int32_t>()[slot];
  if (l.r == 0) return l;
  l.a = reinterpret_cast<const float*>(a.ptr<int64_t>()[slot]) + expert * as.ptr<int64_t>()[slot];
  l.b = reinterpret_cast<const float*>(b.ptr<int64_t>()[slot]) + expert * bs.ptr<int64_t>()[slot];
  return l;
}

// y[o] += B (A x)
void apply_lora(const ExpertLora& l, const double* x, int in, int out, double* y) {
  if (l.r == 0) return;
  std::vector<double> u(l.r, 0.0);
  for (int k = 0; k < l.r; ++k) {
    const float* ar = l.a + static_cast<int64_t>(k) * in;
    double acc = 0.0;
    for (int i = 0; i < in; ++i) acc += x[i] * ar[i];
    u[k] = acc;
  }
  for (int o = 0; o < out; ++o) {
    const float* br = l.b + static_cast<int64_t>(o) * l.r;
    double acc = 0.0;
    for (int k = 0; k < l.r; ++k) acc += u[k] * br[k];
    y[o] += acc;
  }
}

// fp8_activation_round_trip of one row held in double (optionally rounding it to bf16 first).
void fp8_round_trip(const double* in, int n, bool bf16_first, double* out) {
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) {
    f[i] = static_cast<float>(in[i]);
    if (bf16_first) f[i] = bf16_to_f32(f32_to_bf16(f[i]));
  }
  fp8_activation_round_trip(f.data(), n, 1, n, out);
}

}  // namespace

void moe(const MoeArgs& a) {
  const int H = a.H, I = a.I;
  const int total_experts = a.global_experts > 0 ? a.global_experts : a.E;
  MOELORA_CHECK(a.expert_begin >= 0 && a.expert_begin + a.E <= total_experts);
  std::vector<double> x(H), g(2 * I), act(I), d(H), y(H), xq(H), actq(I);
  for (int64_t t = 0; t < a.T; ++t) {
    for (int i = 0; i < H; ++i) x[i] = a.x[t * a.ldx + i];
    if (a.fp8_activations) fp8_round_trip(x.data(), H, /*bf16_first=*/false, xq.data());
    const double* xb = a.fp8_activations ? xq.data() : x.data();  // the base GEMM's input
    std::fill(y.begin(), y.end(), 0.0);
    const int slot = a.slot ? a.slot[t] : -1;
    for (int j = 0; j < a.k; ++j) {
      const int global_id = a.ids[t * a.k + j];
      MOELORA_CHECK_MSG(global_id >= 0 && global_id < total_experts, "expert id {} outside 0..{}", global_id,
                        total_experts - 1);
      if (global_id < a.expert_begin || global_id >= a.expert_begin + a.E) continue;  // another rank's expert
      const int e = global_id - a.expert_begin;  // index into this call's weights
      const float* wgu = a.w_gate_up + static_cast<int64_t>(e) * 2 * I * H;
      for (int o = 0; o < 2 * I; ++o) {
        const float* wr = wgu + static_cast<int64_t>(o) * H;
        double acc = 0.0;
        for (int i = 0; i < H; ++i) acc += xb[i] * wr[i];
        g[o] = acc;
      }
      ExpertLora gu, dn;
      if (a.lora && slot >= 0) {
        MOELORA_CHECK(slot < a.lora->num_slots);
        const MoeLoraTable& L = *a.lora;
        gu = lookup(L.gu_a, L.gu_a_expert_stride, L.gu_b, L.gu_b_expert_stride, L.gu_rank, slot, e);
        dn = lookup(L.d_a, L.d_a_expert_stride, L.d_b, L.d_b_expert_stride, L.d_rank, slot, e);
      }
      apply_lora(gu, x.data(), H, 2 * I, g.data());  // before the activation, unweighted
      for (int i = 0; i < I; ++i) act[i] = g[i] / (1.0 + std::exp(-g[i])) * g[I + i];
      if (a.fp8_activations) fp8_round_trip(act.data(), I, /*bf16_first=*/true, actq.data());
      const double* ab = a.fp8_activations ? actq.data() : act.data();
      const float* wd = a.w_down + static_cast<int64_t>(e) * H * I;
      for (int o = 0; o < H; ++o) {
        const float* wr = wd + static_cast<int64_t>(o) * I;
        double acc = 0.0;
        for (int i = 0; i < I; ++i) acc += ab[i] * wr[i];
        d[o] = acc;
      }
      apply_lora(dn, act.data(), I, H, d.data());
      const double wt = a.weights[t * a.k + j];
      for (int o = 0; o < H; ++o) y[o] += wt * d[o];
    }
    for (int o = 0; o < H; ++o) a.out[t * a.ldo + o] = static_cast<float>(y[o]);
  }
}

}  // namespace moelora::cpu
