// Backend::mla_attention_absorbed on the CPU against a float64 computation written here the
// decompressed way: every cached token's k_nope / v expanded with (W + B A) of its own adapter,
// then plain causal softmax attention. Random small shapes with k != v (nope != v_head_dim),
// tokens on no adapter (-1), on an adapter without kv_b LoRA (rank 0) and on adapters of mixed
// ranks, several sequences of different lengths on scattered pages, over two steps (a chunk that
// reads what an earlier step cached), float32 and FP8 block-scaled kv_b weights.
//
// Bound: the op accumulates in float64 and rounds each output once to float32 (<= 2^-24 = 6e-8
// relative per element), so a row is within 1e-7 of the float64 reference; a wrong head, page,
// mask or adapter (or a dropped kv_b LoRA) moves it by O(1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/dtype.h"

namespace moelora {
namespace {

constexpr double kMaxRowRelError = 1e-7;

struct Shape {
  int heads, nope, rope, v_dim, R;
  bool fp8;  // kv_b as FP8 codes with 4 x 4 block scales (partial edge blocks)
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "heads " << s.heads << " nope " << s.nope << " rope " << s.rope << " v " << s.v_dim << " R " << s.R
      << (s.fp8 ? " fp8" : "");
}

Tensor host(const std::vector<int64_t>& shape, const std::vector<float>& v) {
  Tensor t = Tensor::empty_host(DType::kF32, shape);
  std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  return t;
}

struct Token {
  int seq, pos;
};

class MlaAbsorbedOp : public ::testing::TestWithParam<Shape> {};

TEST_P(MlaAbsorbedOp, MatchesFloat64DecompressedAttentionWithPerTokenKvbLora) {
  const Shape sh = GetParam();
  const int H = sh.heads, nope = sh.nope, rope = sh.rope, vd = sh.v_dim, R = sh.R, F = nope + vd, qk = nope + rope;
  const int P = 2;  // page size: sequences cross pages
  std::mt19937 g(1234 + H * 7 + R);
  auto rnd = [&](size_t n, float s) {
    std::vector<float> v(n);
    for (float& x : v) x = std::uniform_real_distribution<float>(-s, s)(g);
    return v;
  };

  // kv_b [H * F, R]: float values, or FP8 codes dequantised by the backend's upload.
  CpuBackend backend;
  std::vector<float> w(static_cast<size_t>(H) * F * R);
  LinearWeight kv_b;
  if (sh.fp8) {
    const int bo = 4, bi = 4, rb = (H * F + bo - 1) / bo, cb = (R + bi - 1) / bi;
    Tensor codes = Tensor::empty_host(DType::kF8E4M3, {H * F, R});
    for (int64_t i = 0; i < codes.numel(); ++i) {
      const uint32_t bits = g();
      codes.ptr<uint8_t>()[i] = static_cast<uint8_t>((bits % 0x7e) | ((bits >> 16) & 0x80));  // any finite code
    }
    const std::vector<float> sv = rnd(static_cast<size_t>(rb) * cb, 0.01f);
    std::vector<float> scale(sv.size());
    for (size_t i = 0; i < sv.size(); ++i) scale[i] = std::fabs(sv[i]) + 1e-3f;
    StoredWeight stored{WeightFormat::fp8_block(bo, bi), codes, host({rb, cb}, scale), 1.0f, H * F, R};
    kv_b = backend.upload_linear(stored);
    for (int o = 0; o < H * F; ++o)
      for (int i = 0; i < R; ++i)
        w[static_cast<size_t>(o) * R + i] =
            fp8e4m3_to_f32(codes.ptr<uint8_t>()[static_cast<size_t>(o) * R + i]) * scale[(o / bo) * cb + i / bi];
  } else {
    w = rnd(w.size(), 0.5f);
    kv_b = backend.upload_linear(dense_weight(host({H * F, R}, w)));
  }

  // Adapter slots: ranks 3, 0 (adapter without kv_b LoRA), 5, 1.
  const std::vector<int> ranks = {3, 0, 5, 1};
  LoraModuleTable table = backend.alloc_lora_table(static_cast<int>(ranks.size()), R, H * F);
  std::vector<std::vector<float>> A(ranks.size()), B(ranks.size());
  std::vector<Tensor> keep;
  for (size_t s = 0; s < ranks.size(); ++s) {
    const int r = ranks[s];
    if (r == 0) continue;
    A[s] = rnd(static_cast<size_t>(r) * R, 0.5f);
    B[s] = rnd(static_cast<size_t>(H) * F * r, 0.5f);
    keep.push_back(host({r, R}, A[s]));
    keep.push_back(host({H * F, r}, B[s]));
    backend.set_lora_slot(table, static_cast<int>(s), keep[keep.size() - 2], keep.back(), r);
  }

  // Sequences: (length, slot); tokens [0, split) run in step 1, the rest in step 2.
  struct Seq {
    int len, split, slot;
  };
  const std::vector<Seq> seqs = {{1, 1, -1}, {4, 3, 0}, {7, 5, 2}, {3, 0, 1}, {2, 1, 3}, {5, 2, -1}};
  std::vector<std::vector<int32_t>> pages(seqs.size());
  std::vector<int32_t> free_pages;
  int total_pages = 0;
  for (const Seq& s : seqs) total_pages += (s.len + P - 1) / P;
  for (int p = 0; p < total_pages; ++p) free_pages.push_back(p);
  std::shuffle(free_pages.begin(), free_pages.end(), g);  // scattered, out of order
  for (size_t s = 0, next = 0; s < seqs.size(); ++s)
    for (int p = 0; p < (seqs[s].len + P - 1) / P; ++p) pages[s].push_back(free_pages[next++]);
  KvLayer kv = backend.alloc_kv_layer(total_pages, P, 1, R + rope, 0);
  // Rows nobody writes must never be read: NaN would reach the output.
  for (int64_t i = 0; i < kv.k.numel(); ++i) kv.k.ptr<float>()[i] = std::numeric_limits<float>::quiet_NaN();

  // Every token's inputs, over both steps: q (rope dims "rotated" = arbitrary), c, k_pe.
  std::vector<Token> tokens;
  std::vector<int> step_of;
  for (int step = 0; step < 2; ++step)
    for (size_t s = 0; s < seqs.size(); ++s)
      for (int p = step == 0 ? 0 : seqs[s].split; p < (step == 0 ? seqs[s].split : seqs[s].len); ++p) {
        tokens.push_back({static_cast<int>(s), p});
        step_of.push_back(step);
      }
  const size_t N = tokens.size();
  const std::vector<float> q = rnd(N * H * qk, 1.0f), c = rnd(N * R, 1.0f), kpe = rnd(N * rope, 1.0f);
  const float scale = 0.61f;

  // Float64 reference, decompressed: key/value of token j with token j's adapter.
  auto slot_of = [&](size_t j) { return seqs[tokens[j].seq].slot; };
  auto expand = [&](size_t j, int row) {  // row of (W + B A) c_j
    double acc = 0;
    for (int i = 0; i < R; ++i) acc += static_cast<double>(w[static_cast<size_t>(row) * R + i]) * c[j * R + i];
    const int s = slot_of(j);
    if (s >= 0 && ranks[s] > 0)
      for (int k = 0; k < ranks[s]; ++k) {
        double u = 0;
        for (int i = 0; i < R; ++i) u += static_cast<double>(A[s][static_cast<size_t>(k) * R + i]) * c[j * R + i];
        acc += static_cast<double>(B[s][static_cast<size_t>(row) * ranks[s] + k]) * u;
      }
    return acc;
  };
  std::vector<double> ref(N * H * vd);
  for (size_t t = 0; t < N; ++t)
    for (int h = 0; h < H; ++h) {
      std::vector<size_t> js;
      for (size_t j = 0; j < N; ++j)
        if (tokens[j].seq == tokens[t].seq && tokens[j].pos <= tokens[t].pos) js.push_back(j);
      std::vector<double> p;
      double mx = -INFINITY;
      for (size_t j : js) {
        double d = 0;
        for (int e = 0; e < nope; ++e) d += q[(t * H + h) * qk + e] * expand(j, h * F + e);
        for (int e = 0; e < rope; ++e) d += static_cast<double>(q[(t * H + h) * qk + nope + e]) * kpe[j * rope + e];
        p.push_back(d * scale);
        mx = std::max(mx, p.back());
      }
      double z = 0;
      for (double& x : p) z += (x = std::exp(x - mx));
      for (int e = 0; e < vd; ++e) {
        double o = 0;
        for (size_t i = 0; i < js.size(); ++i) o += p[i] / z * expand(js[i], h * F + nope + e);
        ref[(t * H + h) * vd + e] = o;
      }
    }

  // The op, one step at a time; latent and k_pe are column slices of one [T, R + rope] buffer
  // (as kv_a's output is in the forward pass), so their row strides are not their widths.
  double worst = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<size_t> ids;
    for (size_t t = 0; t < N; ++t)
      if (step_of[t] == step) ids.push_back(t);
    const int T = static_cast<int>(ids.size());
    StepBatch b;
    b.seq_pages = pages;
    std::vector<float> qs, ckv;
    for (size_t t : ids) {
      b.token_ids.push_back(0);
      b.positions.push_back(tokens[t].pos);
      b.token_seq.push_back(tokens[t].seq);
      b.token_slot.push_back(slot_of(t));
      qs.insert(qs.end(), q.begin() + t * H * qk, q.begin() + (t + 1) * H * qk);
      ckv.insert(ckv.end(), c.begin() + t * R, c.begin() + (t + 1) * R);
      ckv.insert(ckv.end(), kpe.begin() + t * rope, kpe.begin() + (t + 1) * rope);
    }
    backend.begin_step(b);
    Tensor qt = host({T, H * qk}, qs), ckv_t = host({T, R + rope}, ckv);
    Tensor out = Tensor::empty_host(DType::kF32, {T, H * vd});
    backend.mla_attention_absorbed(qt, ckv_t.slice_cols(0, R), ckv_t.slice_cols(R, rope), kv_b, &table, kv, H, nope,
                                   vd, scale, out);
    for (int i = 0; i < T; ++i) {
      const size_t t = ids[i];
      // The cache row holds the token's c then k_pe, bit for bit.
      const int64_t cache_row = static_cast<int64_t>(pages[tokens[t].seq][tokens[t].pos / P]) * P + tokens[t].pos % P;
      const float* row = kv.k.ptr<float>() + cache_row * (R + rope);
      EXPECT_EQ(std::memcmp(row, ckv.data() + static_cast<size_t>(i) * (R + rope), (R + rope) * sizeof(float)), 0);
      double num = 0, den = 0;
      for (int e = 0; e < H * vd; ++e) {
        const double want = ref[t * H * vd + e], got = out.ptr<float>()[static_cast<int64_t>(i) * H * vd + e];
        num += (got - want) * (got - want);
        den += want * want;
      }
      const double rel = std::sqrt(num / den);
      EXPECT_LE(rel, kMaxRowRelError) << "step " << step << " seq " << tokens[t].seq << " pos " << tokens[t].pos
                                      << " slot " << slot_of(t);
      worst = std::max(worst, std::isfinite(rel) ? rel : INFINITY);
    }
  }
  std::printf("[ absorbed ] worst row relative error %.2e\n", worst);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaAbsorbedOp,
                         ::testing::Values(Shape{3, 5, 4, 7, 6, false}, Shape{2, 8, 2, 3, 11, false},
                                           Shape{4, 4, 6, 4, 8, false}, Shape{3, 5, 4, 7, 6, true},
                                           Shape{1, 6, 4, 9, 13, true}));

// The kv_b LoRA is not dropped: with the adapter's factors zeroed out of the table the output
// moves by O(1) (vLLM's absorbed MLA path does not apply a kv_b_proj LoRA at all, which this
// product must not repeat).
TEST(MlaAbsorbedOpLora, AdapterChangesTheOutputAndBaseTokensIgnoreTheTable) {
  const int H = 2, nope = 4, rope = 2, vd = 3, R = 5, F = nope + vd, r = 2;
  CpuBackend backend;
  std::mt19937 g(5);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = std::uniform_real_distribution<float>(-1, 1)(g);
    return v;
  };
  LinearWeight kv_b = backend.upload_linear(dense_weight(host({H * F, R}, rnd(H * F * R))));
  Tensor a = host({r, R}, rnd(r * R)), bt = host({H * F, r}, rnd(H * F * r));
  LoraModuleTable with = backend.alloc_lora_table(1, R, H * F), without = backend.alloc_lora_table(1, R, H * F);
  backend.set_lora_slot(with, 0, a, bt, r);
  const std::vector<float> q = rnd(3 * H * (nope + rope)), ckv = rnd(3 * (R + rope));
  auto run = [&](int slot, const LoraModuleTable* table) {
    StepBatch b;
    b.seq_pages = {{0, 1}};
    b.token_ids = {0, 0, 0};
    b.positions = {0, 1, 2};
    b.token_seq = {0, 0, 0};
    b.token_slot = {slot, slot, slot};
    backend.begin_step(b);
    KvLayer kv = backend.alloc_kv_layer(2, 2, 1, R + rope, 0);
    Tensor ct = host({3, R + rope}, ckv), out = Tensor::empty_host(DType::kF32, {3, H * vd});
    backend.mla_attention_absorbed(host({3, H * (nope + rope)}, q), ct.slice_cols(0, R), ct.slice_cols(R, rope), kv_b,
                                   table, kv, H, nope, vd, 0.5f, out);
    return std::vector<float>(out.ptr<float>(), out.ptr<float>() + out.numel());
  };
  const auto base = run(-1, nullptr);
  EXPECT_EQ(run(-1, &with), base);       // slot -1 reads no table entry
  EXPECT_EQ(run(0, &without), base);     // rank 0: W only
  const auto adapted = run(0, &with);
  double num = 0, den = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    num += (adapted[i] - base[i]) * (adapted[i] - base[i]);
    den += base[i] * base[i];
  }
  EXPECT_GT(std::sqrt(num / den), 0.05);
}

}  // namespace
}  // namespace moelora
