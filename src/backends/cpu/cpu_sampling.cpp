// The reference of Backend::sample (backend.h states the algorithm, ops/sampling.h its math):
// written as the statement reads — process, sort, cut, draw — with no shortcut the statement
// does not make.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "backends/cpu/cpu_ops.h"
#include "core/check.h"

namespace moelora::cpu {

namespace {

// Tokens by (order_key desc, id asc).
std::vector<int32_t> order_of(const std::vector<float>& v) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
    return sampling::order_key(v[a]) > sampling::order_key(v[b]);
  });
  return idx;
}

std::vector<float> processed_row(const float* raw, int vocab, const SampleRow& r) {
  std::vector<float> p(raw, raw + vocab);
  if (r.restrict_to_allowed) std::fill(p.begin(), p.end(), -INFINITY);
  for (const LogitEdit& e : r.edits) {
    MOELORA_CHECK(e.token >= 0 && e.token < vocab);
    if (r.restrict_to_allowed && !e.allowed) continue;
    p[e.token] = sampling::apply_edit(raw[e.token], e, r.presence, r.frequency, r.repetition);
  }
  return p;
}

int32_t choose(const std::vector<float>& p, const SampleRow& r) {
  std::vector<int32_t> order = order_of(p);
  if (r.temperature <= 0.0f) return order[0];
  const double inv_t = 1.0 / static_cast<double>(r.temperature);
  float pmax = -INFINITY;
  for (float v : p)
    if (std::isfinite(v) && v > pmax) pmax = v;
  if (!std::isfinite(pmax)) return order[0];  // no finite token
  // q of the tokens in the order.
  std::vector<uint64_t> q(order.size());
  for (size_t i = 0; i < order.size(); ++i) q[i] = sampling::mass_q32(p[order[i]], pmax, inv_t);
  size_t keep = order.size();
  if (r.top_k > 0) keep = std::min<size_t>(keep, static_cast<size_t>(r.top_k));
  if (r.top_p < 1.0f) {
    uint64_t z = 0;
    for (size_t i = 0; i < keep; ++i) z += q[i];
    const double target = static_cast<double>(r.top_p) * static_cast<double>(z);
    uint64_t s = 0;
    size_t n = 0;
    while (n < keep) {
      s += q[n++];
      if (static_cast<double>(s) >= target) break;
    }
    keep = n;
  }
  const double min_q = static_cast<double>(r.min_p) * 4294967296.0;
  std::vector<uint64_t> w(keep);
  uint64_t total = 0;
  for (size_t i = 0; i < keep; ++i) {
    w[i] = r.min_p > 0.0f && static_cast<double>(q[i]) < min_q ? 0 : q[i];
    total += w[i];
  }
  if (total == 0) return order[0];
  const uint64_t t = sampling::draw_target(sampling::draw_bits(r.seed, r.step), total);
  uint64_t cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += w[i];
    if (cum > t) return order[i];
  }
  return order[0];  // unreachable: cum reaches total > t
}

}  // namespace

std::vector<SampleOutput> sample(const float* logits, int64_t ld, int vocab, const std::vector<SampleRow>& rows) {
  std::vector<SampleOutput> out(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const SampleRow& row = rows[r];
    MOELORA_CHECK(row.logprobs >= 0 && row.logprobs <= kMaxTopLogprobs);
    const float* raw = logits + static_cast<int64_t>(r) * ld;
    const std::vector<float> p = row.has_processing() ? processed_row(raw, vocab, row) : std::vector<float>(raw, raw + vocab);
    SampleOutput& o = out[r];
    o.token = choose(p, row);
    double mx = -INFINITY;
    for (int i = 0; i < vocab; ++i)
      if (raw[i] > mx) mx = raw[i];
    double z = 0;
    for (int i = 0; i < vocab; ++i)
      if (raw[i] > -INFINITY) z += std::exp(raw[i] - mx);
    const double lse = mx + std::log(z);
    o.logprob = static_cast<float>(raw[o.token] - lse);
    if (row.logprobs > 0) {
      const std::vector<int32_t> order = order_of(std::vector<float>(raw, raw + vocab));
      for (int i = 0; i < std::min(row.logprobs, vocab); ++i)
        o.top_logprobs.emplace_back(order[i], static_cast<float>(raw[order[i]] - lse));
    }
  }
  return out;
}

}  // namespace moelora::cpu
