// CPU reference: rotary embeddings and paged causal attention.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"

namespace moelora::cpu {

void rope(float* x, int64_t ldx, int64_t T, const int32_t* positions, int heads, int head_stride,
          int rot_offset, const RopeTable& rope) {
  const int half = rope.rot_dim / 2;
  MOELORA_CHECK(static_cast<int>(rope.inv_freq.size()) == half);
  MOELORA_CHECK(rot_offset + rope.rot_dim <= head_stride);
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      // Angles in float32 as transformers computes them (inv_freq and positions are f32 there).
      const float angle = static_cast<float>(positions[t]) * rope.inv_freq[i];
      const double c = static_cast<double>(static_cast<float>(std::cos(static_cast<double>(angle))) *
                                           rope.attention_factor);
      const double s = static_cast<double>(static_cast<float>(std::sin(static_cast<double>(angle))) *
                                           rope.attention_factor);
      for (int h = 0; h < heads; ++h) {
        float* base = x + t * ldx + static_cast<int64_t>(h) * head_stride + rot_offset;
        float* p1 = rope.interleaved ? base + 2 * i : base + i;
        float* p2 = rope.interleaved ? base + 2 * i + 1 : base + i + half;
        const double x1 = *p1, x2 = *p2;
        *p1 = static_cast<float>(x1 * c - x2 * s);
        *p2 = static_cast<float>(x2 * c + x1 * s);
      }
    }
  }
}

int64_t cache_row(const StepBatch& b, int seq, int pos, int page_size) {
  const auto& pages = b.seq_pages[seq];
  const int page_index = pos / page_size;
  MOELORA_CHECK_MSG(page_index < static_cast<int>(pages.size()), "position {} beyond the {} pages of seq {}",
                    pos, pages.size(), seq);
  return static_cast<int64_t>(pages[page_index]) * page_size + pos % page_size;
}

void softmax_weights(double* p, int n) {
  double mx = -INFINITY;
  for (int j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  double sum = 0.0;
  for (int j = 0; j < n; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  for (int j = 0; j < n; ++j) p[j] /= sum;
}

void attention(const AttentionArgs& a, KvLayer& kv) {
  const int kw = kv.kv_heads * kv.k_head_dim;
  const int vw = kv.kv_heads * kv.v_head_dim;
  MOELORA_CHECK(a.heads % kv.kv_heads == 0);
  const int group = a.heads / kv.kv_heads;
  float* kc = kv.k.ptr<float>();
  float* vc = kv.v.ptr<float>();
  // 1. Every token of the step enters the cache first, so a prefill chunk sees itself.
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t row = cache_row(*a.batch, a.token_seq[t], a.positions[t], kv.page_size);
    for (int i = 0; i < kw; ++i) kc[row * kw + i] = a.k[t * a.ldk + i];
    for (int i = 0; i < vw; ++i) vc[row * vw + i] = a.v[t * a.ldv + i];
  }
  // 2. Causal attention over the token's own sequence.
  std::vector<double> p;
  std::vector<double> acc(kv.v_head_dim);
  for (int64_t t = 0; t < a.T; ++t) {
    const int seq = a.token_seq[t];
    const int n = a.positions[t] + 1;
    p.resize(n);
    for (int h = 0; h < a.heads; ++h) {
      const int g = h / group;
      const float* q = a.q + t * a.ldq + static_cast<int64_t>(h) * kv.k_head_dim;
      for (int j = 0; j < n; ++j) {
        const float* kr = kc + cache_row(*a.batch, seq, j, kv.page_size) * kw + static_cast<int64_t>(g) * kv.k_head_dim;
        double dot = 0.0;
        for (int d = 0; d < kv.k_head_dim; ++d) dot += static_cast<double>(q[d]) * kr[d];
        p[j] = dot * a.scale;
      }
      softmax_weights(p.data(), n);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int j = 0; j < n; ++j) {
        const float* vr = vc + cache_row(*a.batch, seq, j, kv.page_size) * vw + static_cast<int64_t>(g) * kv.v_head_dim;
        const double w = p[j];
        for (int d = 0; d < kv.v_head_dim; ++d) acc[d] += w * vr[d];
      }
      float* o = a.out + t * a.ldo + static_cast<int64_t>(h) * kv.v_head_dim;
      for (int d = 0; d < kv.v_head_dim; ++d) o[d] = static_cast<float>(acc[d]);
    }
  }
}

}  // namespace moelora::cpu
