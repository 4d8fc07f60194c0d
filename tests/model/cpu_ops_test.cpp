// The CPU reference against naive float64 computations written here independently, for the ops
// that are not trivially that already: FP8 coding and block dequantisation, routing (ties,
// DeepSeek groups and bias), LoRA with mixed ranks and base-only tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_ops.h"
#include "core/dtype.h"
#include "ops/weight_format.h"

namespace moelora {
namespace {

TEST(Fp8, DecodesEveryCodeExactly) {
  for (int code = 0; code < 256; ++code) {
    const int sign = code >> 7, exp = (code >> 3) & 15, mant = code & 7;
    const float v = fp8e4m3_to_f32(static_cast<uint8_t>(code));
    if (exp == 15 && mant == 7) {
      EXPECT_TRUE(std::isnan(v)) << code;
      continue;
    }
    const double mag = exp == 0 ? mant / 8.0 * std::pow(2.0, -6) : (1.0 + mant / 8.0) * std::pow(2.0, exp - 7);
    EXPECT_EQ(static_cast<double>(v), sign ? -mag : mag) << code;
  }
  EXPECT_EQ(fp8e4m3_to_f32(0x7e), 448.0f);
}

TEST(Fp8, EncodeRoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 256; ++code) {
    const float v = fp8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(v)) continue;
    if (v == 0.0f) continue;  // -0 and +0
    EXPECT_EQ(f32_to_fp8e4m3(v), code) << v;
  }
  EXPECT_EQ(f32_to_fp8e4m3(1000.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-1000.0f), 0xfe);
  // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): ties to even.
  EXPECT_EQ(f32_to_fp8e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_fp8e4m3(1.1875f), 0x3a);
}

TEST(Fp8, BlockDequantisationWithPartialEdgeBlocksAndSplitRows) {
  const int rows = 2 * 192, cols = 200, bo = 128, bi = 128, split = 192;  // fused gate|up, I = 192
  std::mt19937 g(7);
  std::vector<uint8_t> q(rows * cols);
  for (auto& x : q) x = static_cast<uint8_t>(g() % 0x7e);
  // Scale rows: 2 blocks for the gate half + 2 for the up half; 2 column blocks.
  std::vector<float> scale(4 * 2);
  for (auto& s : scale) s = std::uniform_real_distribution<float>(0.01f, 2.0f)(g);
  std::vector<float> out(rows * cols);
  dequantize_fp8_block(q.data(), rows, cols, scale.data(), bo, bi, split, out.data());
  for (int i = 0; i < rows; i += 7)
    for (int j = 0; j < cols; j += 3) {
      const int half = i < split ? 0 : 1, local = i - half * split;
      const int rb = half * 2 + local / bo;
      const double want = static_cast<double>(fp8e4m3_to_f32(q[i * cols + j])) * scale[rb * 2 + j / bi];
      EXPECT_NEAR(out[i * cols + j], want, std::fabs(want) * 1e-7) << i << "," << j;
    }
}

// NVFP4's element type from the bits alone (sign, 2-bit exponent with bias 1, 1 mantissa bit),
// written here independently of the decoder.
TEST(Nvfp4, DecodesEveryE2M1CodeExactly) {
  const double expected[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    const int e = (c >> 1) & 3, m = c & 1;
    const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
    EXPECT_EQ(static_cast<double>(fp4e2m1_to_f32(static_cast<uint8_t>(c))), (c & 8) ? -mag : mag) << c;
    EXPECT_EQ(static_cast<double>(fp4e2m1_to_f32(static_cast<uint8_t>(c))), expected[c]) << c;
    EXPECT_EQ(std::signbit(fp4e2m1_to_f32(static_cast<uint8_t>(c))), (c & 8) != 0) << c;  // -0 keeps its sign
  }
  EXPECT_EQ(fp4e2m1_to_f32(0xF3), fp4e2m1_to_f32(0x03));  // only the low nibble counts
}

// Dequantisation: element order within a byte (low nibble first), one e4m3 scale per 16 values,
// the global scale, and scale edge cases (e4m3 subnormal, zero, the largest, NaN); every value
// equals the float64 product rounded once to f32 (the first product is exact).
TEST(Nvfp4, DequantisationFollowsModelOptLayoutAndRoundsOnce) {
  const int rows = 3, cols = 48;
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 16);
  std::mt19937 g(9);
  for (auto& b : packed) b = static_cast<uint8_t>(g() & 0xff);
  const uint8_t scale_codes[9] = {0x38 /*1.0*/, 0x01 /*2^-9, subnormal*/, 0x00 /*0*/, 0x7e /*448*/, 0x45, 0x2a,
                                  0xb8 /*-1.0*/, 0x7f /*NaN*/, 0x07 /*largest subnormal*/};
  for (int i = 0; i < rows * cols / 16; ++i) scales[i] = scale_codes[i % 9];
  const float global = 1.0f / (6.0f * 448.0f);  // ModelOpt's weight_scale_2 = amax / (6 * 448) for amax 1
  std::vector<float> out(rows * cols);
  dequantize_nvfp4(packed.data(), rows, cols, scales.data(), global, out.data());
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const uint8_t byte = packed[i * cols / 2 + j / 2];
      const int code = j % 2 == 0 ? byte & 15 : byte >> 4;
      const int e = (code >> 1) & 3, m = code & 1;
      double v = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
      if (code & 8) v = -v;
      const uint8_t sc = scales[i * cols / 16 + j / 16];
      const double s = fp8e4m3_to_f32(sc);
      const float got = out[i * cols + j];
      if (sc == 0x7f) {
        EXPECT_TRUE(std::isnan(got)) << i << "," << j;
        continue;
      }
      EXPECT_EQ(got, static_cast<float>(v * s * static_cast<double>(global))) << i << "," << j;
    }
  // The low nibble is the even element: byte 0x21 -> (0.5, 1.0).
  const uint8_t two[8] = {0x21, 0, 0, 0, 0, 0, 0, 0}, one_scale = 0x38;
  float pair[16];
  dequantize_nvfp4(two, 1, 16, &one_scale, 1.0f, pair);
  EXPECT_EQ(pair[0], 0.5f);
  EXPECT_EQ(pair[1], 1.0f);
}

TEST(Fp8, ActivationQuantisationErrorIsBoundedPerGroup) {
  std::mt19937 g(3);
  const int T = 3, K = 300, group = 128;
  std::vector<float> x(T * K);
  for (auto& v : x) v = std::normal_distribution<float>(0, 2)(g);
  std::fill(x.begin() + 128, x.begin() + 256, 0.0f);  // an all-zero group
  std::vector<uint8_t> q(T * K);
  std::vector<float> s(T * 3);
  cpu::quantize_fp8_per_token_group(x.data(), T, K, group, q.data(), s.data());
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < K; ++c) {
      const float back = fp8e4m3_to_f32(q[t * K + c]) * s[t * 3 + c / group];
      // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values.
      EXPECT_LE(std::fabs(back - x[t * K + c]), std::fabs(x[t * K + c]) / 16 + s[t * 3 + c / group] * std::pow(2, -9));
    }
  EXPECT_EQ(s[1], 1.0f);
}

TEST(Routing, SoftmaxTopKTiesPickTheLowerExpertFirst) {
  const std::vector<float> logits = {1, 3, 3, 0, 3, -1};
  int32_t ids[3];
  float w[3];
  cpu::topk_softmax(logits.data(), 1, 6, 3, true, ids, w);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 4);
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-6);
  EXPECT_NEAR(w[0], 1.0 / 3, 1e-6);
  cpu::topk_softmax(logits.data(), 1, 6, 2, false, ids, w);
  double z = 0;
  for (float l : logits) z += std::exp(l);
  EXPECT_NEAR(w[0], std::exp(3.0) / z, 1e-6);
}

// Brute force of DeepSeek-V3 group-limited routing, written independently of cpu_moe.cpp.
void naive_grouped(const std::vector<double>& logits, const std::vector<double>& bias, int k, int n_group, int topk_group,
                   double rsf, std::vector<int>* ids, std::vector<double>* w) {
  const int E = static_cast<int>(logits.size()), per = E / n_group;
  std::vector<double> s(E), c(E);
  for (int e = 0; e < E; ++e) s[e] = 1 / (1 + std::exp(-logits[e])), c[e] = s[e] + bias[e];
  std::vector<std::pair<double, int>> gs;
  for (int g = 0; g < n_group; ++g) {
    std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
    std::sort(v.rbegin(), v.rend());
    gs.push_back({-(v[0] + (per > 1 ? v[1] : 0)), g});
  }
  std::sort(gs.begin(), gs.end());
  std::vector<bool> keep(n_group);
  for (int i = 0; i < topk_group; ++i) keep[gs[i].second] = true;
  std::vector<std::pair<double, int>> cand;
  for (int e = 0; e < E; ++e) cand.push_back({-(keep[e / per] ? c[e] : 0.0), e});
  std::sort(cand.begin(), cand.end());
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += s[cand[j].second];
  ids->clear();
  w->clear();
  for (int j = 0; j < k; ++j) {
    ids->push_back(cand[j].second);
    w->push_back(s[cand[j].second] / (sum + 1e-20) * rsf);
  }
}

TEST(Routing, DeepSeekGroupLimitedMatchesBruteForce) {
  std::mt19937 g(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int n_group = 1 << (trial % 4), per = 2 + trial % 5, E = n_group * per;
    const int topk_group = 1 + trial % n_group, k = std::min(E, 1 + trial % 8);
    std::vector<float> lf(E), bf(E);
    std::vector<double> l(E), b(E);
    for (int e = 0; e < E; ++e) {
      lf[e] = std::normal_distribution<float>(0, 1)(g);
      bf[e] = std::normal_distribution<float>(0, trial % 2 ? 0.1f : 3.0f)(g);  // large bias: negative choices
      l[e] = lf[e], b[e] = bf[e];
    }
    if (trial % 10 == 0) std::fill(lf.begin(), lf.end(), 0.5f), std::fill(l.begin(), l.end(), 0.5);  // ties
    std::vector<int32_t> ids(k);
    std::vector<float> w(k);
    cpu::topk_sigmoid_grouped(lf.data(), bf.data(), 1, E, k, n_group, topk_group, true, 2.5f, ids.data(), w.data());
    std::vector<int> want_ids;
    std::vector<double> want_w;
    naive_grouped(l, b, k, n_group, topk_group, 2.5, &want_ids, &want_w);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(ids[j], want_ids[j]) << "trial " << trial << " j " << j;
      EXPECT_NEAR(w[j], want_w[j], 1e-5) << "trial " << trial;
    }
  }
}

TEST(Lora, MixedRanksAndBaseTokensMatchNaiveFloat64) {
  CpuBackend backend;
  const int in = 37, out = 29, S = 4, T = 9;
  const std::vector<int> ranks = {1, 0, 7, 64};  // slot 1 lacks this module
  LoraModuleTable table = backend.alloc_lora_table(S, in, out);
  std::mt19937 g(5);
  auto rnd = [&](int64_t r, int64_t c) {
    Tensor t = Tensor::empty_host(DType::kF32, {r, c});
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = std::normal_distribution<float>(0, 1)(g);
    return t;
  };
  std::vector<Tensor> A(S), B(S);
  for (int s = 0; s < S; ++s) {
    if (ranks[s] == 0) continue;
    A[s] = rnd(ranks[s], in);
    B[s] = rnd(out, ranks[s]);
    backend.set_lora_slot(table, s, A[s], B[s], ranks[s]);
  }
  const std::vector<int32_t> slot = {0, -1, 2, 3, 1, 3, -1, 0, 2};
  Tensor x = rnd(T, in), y = rnd(T, out);
  std::vector<float> y0(y.ptr<float>(), y.ptr<float>() + y.numel());
  cpu::lora_add(x.ptr<float>(), in, T, slot.data(), table, y.ptr<float>(), out);
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < out; ++o) {
      double want = y0[t * out + o];
      const int s = slot[t];
      if (s >= 0 && ranks[s] > 0)
        for (int k = 0; k < ranks[s]; ++k) {
          double u = 0;
          for (int i = 0; i < in; ++i) u += static_cast<double>(A[s].ptr<float>()[k * in + i]) * x.ptr<float>()[t * in + i];
          want += u * B[s].ptr<float>()[o * ranks[s] + k];
        }
      EXPECT_NEAR(y.ptr<float>()[t * out + o], want, 1e-4 * (1 + std::fabs(want))) << t << "," << o;
    }
}

// The W8A8 regime of the CUDA FP8 experts (cpu::MoeArgs::fp8_activations): the base GEMMs read
// e4m3 round trips of x and of bf16(act), written out here in float64 from the spec; the result
// must also stay within e4m3's error of the exact layer, and differ from it (it does quantise).
TEST(Moe, Fp8ActivationsQuantiseTheBaseGemmInputsOnly) {
  const int T = 5, E = 3, k = 2, H = 160, I = 96;  // H: a partial second 128-channel group
  std::mt19937 g(11);
  auto normals = [&](size_t n, float sd) {
    std::vector<float> v(n);
    for (auto& f : v) f = std::normal_distribution<float>(0, sd)(g);
    return v;
  };
  const std::vector<float> x = normals(static_cast<size_t>(T) * H, 1.0f);
  const std::vector<float> wgu = normals(static_cast<size_t>(E) * 2 * I * H, 0.08f);
  const std::vector<float> wd = normals(static_cast<size_t>(E) * H * I, 0.1f);
  const std::vector<int32_t> ids = {0, 2, 1, 0, 2, 1, 0, 1, 2, 0};
  const std::vector<float> w = {0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f, 0.6f, 0.4f, 0.2f, 0.8f};
  auto run = [&](bool fp8) {
    std::vector<float> out(static_cast<size_t>(T) * H);
    cpu::MoeArgs a{x.data(), H, T, k, ids.data(), w.data(), nullptr, wgu.data(), wd.data(), E, H, I, nullptr,
                   out.data(), H};
    a.fp8_activations = fp8;
    cpu::moe(a);
    return out;
  };
  const std::vector<float> exact = run(false), w8a8 = run(true);
  auto round_trip = [](std::vector<float> v) {
    const int n = static_cast<int>(v.size());
    std::vector<uint8_t> q(n);
    std::vector<float> sc((n + 127) / 128);
    cpu::quantize_fp8_per_token_group(v.data(), 1, n, 128, q.data(), sc.data());
    for (int i = 0; i < n; ++i) v[i] = fp8e4m3_to_f32(q[i]) * sc[i / 128];
    return v;
  };
  for (int t = 0; t < T; ++t) {
    const std::vector<float> xq = round_trip(std::vector<float>(x.begin() + t * H, x.begin() + (t + 1) * H));
    std::vector<double> want(H, 0.0);
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      std::vector<float> act(I);
      for (int i = 0; i < I; ++i) {
        double gate = 0, up = 0;
        for (int h = 0; h < H; ++h) {
          gate += static_cast<double>(xq[h]) * wgu[(static_cast<size_t>(e) * 2 * I + i) * H + h];
          up += static_cast<double>(xq[h]) * wgu[(static_cast<size_t>(e) * 2 * I + I + i) * H + h];
        }
        act[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(gate / (1.0 + std::exp(-gate)) * up)));
      }
      const std::vector<float> aq = round_trip(act);
      for (int o = 0; o < H; ++o) {
        double d = 0;
        for (int i = 0; i < I; ++i) d += static_cast<double>(aq[i]) * wd[(static_cast<size_t>(e) * H + o) * I + i];
        want[o] += w[t * k + j] * d;
      }
    }
    double err = 0, norm = 0, diff = 0;
    for (int o = 0; o < H; ++o) {
      const double got = w8a8[t * H + o];
      err += (got - want[o]) * (got - want[o]);
      norm += want[o] * want[o];
      diff += (got - exact[t * H + o]) * (got - exact[t * H + o]);
    }
    // Against the spec written out: f32 vs f64 act before its bf16 rounding can flip a few e4m3
    // roundings of act (one step, 2^-3), so not bit-exact; 1e-2 still catches any skipped or
    // misplaced quantisation (2-6 % per row, the next bound).
    EXPECT_LE(std::sqrt(err / norm), 1e-2) << "token " << t;
    const double rel = std::sqrt(diff / norm);
    EXPECT_GT(rel, 1e-3) << "token " << t << ": W8A8 must differ from the exact layer";
    EXPECT_LT(rel, 8e-2) << "token " << t << ": more than e4m3's error";
  }
}

TEST(Attention, PagedCausalAttentionMatchesNaive) {
  // Two sequences with scattered pages; GQA with 4 query heads over 2 kv heads.
  const int heads = 4, kv_heads = 2, dk = 6, dv = 5, P = 2;
  CpuBackend backend;
  KvLayer kv = backend.alloc_kv_layer(8, P, kv_heads, dk, dv);
  StepBatch b;
  b.seq_pages = {{5, 1, 6}, {0, 7}};
  const std::vector<int> seq = {0, 0, 0, 0, 0, 1, 1, 1};
  const std::vector<int> pos = {0, 1, 2, 3, 4, 0, 1, 2};
  const int T = 8;
  std::mt19937 g(9);
  auto rnd = [&](int n) {
    std::vector<float> v(n);
    for (auto& x : v) x = std::normal_distribution<float>(0, 1)(g);
    return v;
  };
  auto q = rnd(T * heads * dk), k = rnd(T * kv_heads * dk), v = rnd(T * kv_heads * dv);
  std::vector<float> out(T * heads * dv);
  cpu::AttentionArgs a{q.data(), heads * dk, k.data(), kv_heads * dk, v.data(), kv_heads * dv, out.data(), heads * dv,
                       T, heads, 0.37f, pos.data(), seq.data(), &b};
  cpu::attention(a, kv);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h) {
      const int g2 = h / (heads / kv_heads);
      std::vector<double> p;
      std::vector<int> js;
      for (int j = 0; j < T; ++j)
        if (seq[j] == seq[t] && pos[j] <= pos[t]) js.push_back(j);
      double mx = -1e300;
      for (int j : js) {
        double d = 0;
        for (int c = 0; c < dk; ++c) d += static_cast<double>(q[(t * heads + h) * dk + c]) * k[(j * kv_heads + g2) * dk + c];
        p.push_back(d * 0.37f);
        mx = std::max(mx, p.back());
      }
      double z = 0;
      for (double& x : p) z += (x = std::exp(x - mx));
      for (int c = 0; c < dv; ++c) {
        double want = 0;
        for (size_t i = 0; i < js.size(); ++i) want += p[i] / z * v[(js[i] * kv_heads + g2) * dv + c];
        EXPECT_NEAR(out[(t * heads + h) * dv + c], want, 1e-5);
      }
    }
}

}  // namespace
}  // namespace moelora
