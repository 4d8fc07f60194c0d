// Op suite: dense projections (dense_gemm.cuh) against cpu::linear on exactly dequantised weights.
// Small-M kernel (W8A16 / W4A16 / bf16), naive kernel, and the dispatcher's cuBLASLt paths (FP8
// W8A8 is compared with the reference fed the same quantised activations; NVFP4 above the small-M
// range with the reference on the bf16-rounded weight it dequantises to).
#include "backends/cuda/kernels/dense_gemm.cuh"
#include "gpukit/dense.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// bf16 output: one rounding per element (<= 2^-9 relative) over f32 accumulation of exact
// products (K <= 4096: ~1e-6): 4e-3 row-relative, as the elementwise ops.
constexpr double kBf16Out = 4e-3;
// f32 output: only f32 summation order differs from the f64 reference (sqrt(K) * 2^-24 * a
// cancellation factor of a few for random data): 2e-5.
constexpr double kF32Out = 2e-5;

enum class Path { kSmall, kNaive, kDispatch };

struct DenseCase {
  int M = 1, out = 192, in = 128, split = 0, ld_pad = 0;
  bool fp8 = true, f32_out = false;
  bool nvfp4 = false;  // NVFP4 weight (fp8 ignored); split = two parts with their own global scales
  int scratch_rows = 0;  // NVFP4 dispatch: scratch for this many dequantised rows (0: the full pass)
  Path path = Path::kSmall;
  std::string name() const {
    const char* pn = path == Path::kSmall ? "small" : path == Path::kNaive ? "naive" : "dispatch";
    return std::string("DENSE(M=") + std::to_string(M) + ",out=" + std::to_string(out) + ",in=" + std::to_string(in) +
           (nvfp4 ? ",nvfp4" : fp8 ? ",fp8" : ",bf16") + (split ? ",split=" + std::to_string(split) : "") + (f32_out ? ",f32out" : "") +
           (ld_pad ? ",ld+" + std::to_string(ld_pad) : "") +
           (scratch_rows ? ",scratch_rows=" + std::to_string(scratch_rows) : "") + "," + pn + ")";
  }
};

void PrintTo(const DenseCase& c, std::ostream* os) { *os << c.name(); }

class Dense : public ::testing::TestWithParam<DenseCase> {};

TEST_P(Dense, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const DenseCase c = GetParam();
  Rng rng(seed_of(c.name()));
  DevMat x(c.M, c.in, c.in + c.ld_pad);
  x.randomize(rng);
  Fp8Weight fw;
  Nvfp4Weight nw;
  std::vector<float> wref;
  DeviceArray<uint8_t> wq, wgs;
  DeviceArray<float> ws;
  DevMat wb;
  cuda::DenseArgs a;
  a.x = x.ptr();
  a.ld_x = x.ld;
  a.M = c.M;
  a.w.out = c.out;
  a.w.in = c.in;
  if (c.nvfp4) {
    nw.generate(rng, c.out, c.in, c.split);
    wq = DeviceArray<uint8_t>(nw.codes_packed);
    wgs = DeviceArray<uint8_t>(nw.scale);
    ws = DeviceArray<float>(nw.global_rows);
    a.w.w = wq.get();
    a.w.type = cuda::WeightType::kNvfp4;
    a.w.group_scale = wgs.get();
    a.w.global_scale = ws.get();
    wref = nw.deq;
  } else if (c.fp8) {
    fw.generate(rng, c.out, c.in, c.split);
    wq = DeviceArray<uint8_t>(fw.q);
    ws = DeviceArray<float>(fw.scale);
    a.w.w = wq.get();
    a.w.type = cuda::WeightType::kFP8E4M3;
    a.w.scale_inv = ws.get();
    a.w.split_rows = c.split;
    wref = fw.deq;
  } else {
    wb = DevMat(c.out, c.in);
    wb.randomize(rng, 1.0f / std::sqrt(static_cast<float>(c.in)));
    a.w.w = wb.ptr();
    a.w.type = cuda::WeightType::kBF16;
    wref = wb.host;
  }
  const int ldy = c.out + c.ld_pad;
  DevMat y(c.M, c.out, ldy);
  DeviceArray<float> yf(std::max<size_t>(static_cast<size_t>(c.M) * ldy, 1));
  yf.poison();
  if (c.f32_out)
    a.y_f32 = yf.get();
  else
    a.y = y.ptr();
  a.ld_y = ldy;

  // References: exact activations (our kernel, W8A16) and, for the dispatcher's FP8 prefill path
  // (cuBLASLt, W8A8), activations quantised per token per 128 channels the way the GPU does.
  std::vector<float> ref(static_cast<size_t>(c.M) * c.out), ref_q;
  cpu::linear(x.host.data(), c.in, c.M, wref.data(), c.out, c.in, ref.data(), c.out);
  const bool maybe_w8a8 = c.fp8 && !c.nvfp4 && c.path == Path::kDispatch;
  const bool maybe_bf16_weight = c.nvfp4 && c.path == Path::kDispatch;  // dequantised to bf16 for cuBLASLt
  if (maybe_w8a8) {
    const std::vector<float> xq = fp8_activation_round_trip(x.host.data(), c.in, c.M, c.in);
    ref_q.resize(ref.size());
    cpu::linear(xq.data(), c.in, c.M, wref.data(), c.out, c.in, ref_q.data(), c.out);
  }
  if (maybe_bf16_weight) {
    std::vector<float> wr(wref);
    for (auto& w : wr) w = bf16_to_f32(f32_to_bf16(w));
    ref_q.resize(ref.size());
    cpu::linear(x.host.data(), c.in, c.M, wr.data(), c.out, c.in, ref_q.data(), c.out);
  }

  cuda::DenseGemmContext ctx;
  const size_t nvfp4_scratch = c.scratch_rows ? static_cast<size_t>(c.scratch_rows) * c.in * 2 + 256
                                              : cuda::dense_nvfp4_scratch_bytes(c.out, c.in);
  DeviceArray<uint8_t> scratch(c.nvfp4 ? nvfp4_scratch : cuda::dense_fp8_scratch_bytes(std::max(c.M, 1), c.in));
  switch (c.path) {
    case Path::kSmall: cuda::launch_dense_small_m(a, nullptr); break;
    case Path::kNaive: cuda::launch_dense_naive(a, nullptr); break;
    case Path::kDispatch: cuda::dense_linear(ctx, a, {scratch.get(), scratch.size()}, nullptr); break;
  }
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  if (c.f32_out) {
    std::vector<float> full = yf.download(), got(ref.size());
    for (int t = 0; t < c.M; ++t)
      for (int n = 0; n < c.out; ++n) got[t * c.out + n] = full[t * ldy + n];
    if (maybe_bf16_weight) {  // each row: the exact NVFP4 weight (our kernel) or its bf16 rounding (cuBLASLt)
      for (int t = 0; t < c.M; ++t) {
        const std::vector<float> g(got.begin() + t * c.out, got.begin() + (t + 1) * c.out);
        const auto e1 = compare_rows(g, std::vector<float>(ref.begin() + t * c.out, ref.begin() + (t + 1) * c.out), 1, c.out);
        const auto e2 = compare_rows(g, std::vector<float>(ref_q.begin() + t * c.out, ref_q.begin() + (t + 1) * c.out), 1, c.out);
        EXPECT_FALSE(e1.non_finite) << "row " << t;
        EXPECT_LE(std::min(e1.worst_rel, e2.worst_rel), kF32Out) << "row " << t;
      }
    } else {
      EXPECT_CLOSE_ROWS(got, ref, c.M, c.out, kF32Out);
    }
    EXPECT_TRUE(yf.guard_intact());
  } else if (maybe_w8a8 || maybe_bf16_weight) {
    // Which rows the dispatcher sends through cuBLASLt (W8A8; NVFP4 as bf16) is its policy, not the
    // contract: every row must match one of the two references. For W8A8 they differ by ~3 %
    // (activation quantisation), so this still catches any wrong row; for NVFP4 by ~1e-3 (bf16
    // weights), while a wrong row, scale or part is off by O(1).
    const std::vector<float> got = y.download();
    for (int t = 0; t < c.M; ++t) {
      const std::vector<float> g(got.begin() + t * c.out, got.begin() + (t + 1) * c.out);
      const std::vector<float> r1(ref.begin() + t * c.out, ref.begin() + (t + 1) * c.out);
      const std::vector<float> r2(ref_q.begin() + t * c.out, ref_q.begin() + (t + 1) * c.out);
      const auto e1 = compare_rows(g, r1, 1, c.out), e2 = compare_rows(g, r2, 1, c.out);
      EXPECT_FALSE(e1.non_finite) << "row " << t;
      EXPECT_LE(std::min(e1.worst_rel, e2.worst_rel), kBf16Out) << "row " << t << ": W8A16 " << e1.worst_rel
                                                                 << ", W8A8 " << e2.worst_rel;
    }
    EXPECT_TRUE(y.padding_intact());
  } else {
    EXPECT_CLOSE_ROWS(y.download(), ref, c.M, c.out, kBf16Out);
    EXPECT_TRUE(y.padding_intact());
  }
}

std::vector<DenseCase> dense_cases() {
  std::vector<DenseCase> v;
  // Tiny-model shapes (partial edge blocks: 192 = 128 + 64 rows or columns, in = 96 / 64), M = 0..64.
  const int shapes[][3] = {{192, 128, 0}, {384, 128, 192}, {128, 192, 0}, {192, 96, 0}, {256, 64, 0}, {200, 160, 0}};
  for (auto& s : shapes)
    for (int M : {0, 1, 3, 8, 17, 64})
      for (bool fp8 : {true, false}) {
        if (!fp8 && s[2]) continue;
        DenseCase c;
        c.M = M, c.out = s[0], c.in = s[1], c.split = s[2], c.fp8 = fp8;
        v.push_back(c);
      }
  // Qwen3-30B-A3B shapes at decode sizes, strided activations and outputs.
  for (int M : {1, 8, 33, 64})
    for (bool fp8 : {true, false}) {
      DenseCase c;
      c.M = M, c.out = 4096, c.in = 2048, c.fp8 = fp8, c.ld_pad = M == 33 ? 8 : 0;
      v.push_back(c);
      c.out = 2048, c.in = 4096;
      v.push_back(c);
      c.out = 512, c.in = 2048;
      v.push_back(c);
    }
  // lm_head style f32 logits.
  for (int M : {1, 5}) {
    DenseCase c;
    c.M = M, c.out = 1000, c.in = 256, c.fp8 = false, c.f32_out = true;
    v.push_back(c);
    c.fp8 = true;
    v.push_back(c);
  }
  // NVFP4 (W4A16 small-M kernel; naive; dispatcher: small-M up to 256 tokens, bf16 cuBLASLt on the
  // dequantised weight above): edge row tiles, two parts with their own global scales, strided
  // activations and outputs, f32 logits, Qwen3-30B-A3B shapes.
  {
    const int nshapes[][3] = {{192, 128, 0}, {384, 128, 192}, {128, 192, 0}, {256, 64, 0}, {200, 160, 72}};
    for (auto& s : nshapes)
      for (int M : {0, 1, 3, 8, 17, 64}) {
        DenseCase c;
        c.M = M, c.out = s[0], c.in = s[1], c.split = s[2], c.nvfp4 = true, c.ld_pad = M == 17 ? 8 : 0;
        v.push_back(c);
      }
    for (int M : {1, 8, 64, 256}) {
      DenseCase c;
      c.M = M, c.out = 4096, c.in = 2048, c.split = 3072, c.nvfp4 = true;  // q | k+v style
      v.push_back(c);
      c.out = 2048, c.in = 4096, c.split = 0;
      v.push_back(c);
    }
    for (int M : {1, 5}) {
      DenseCase c;
      c.M = M, c.out = 1000, c.in = 256, c.nvfp4 = true, c.f32_out = true;
      v.push_back(c);
    }
    for (int in : {96, 80}) {  // the naive kernel (in % 32 != 0 reaches it from the small-M launcher too)
      DenseCase c;
      c.M = 3, c.out = 40, c.in = in, c.nvfp4 = true, c.path = in == 96 ? Path::kNaive : Path::kSmall;
      v.push_back(c);
    }
    for (int M : {1, 256, 257, 300}) {
      DenseCase c;
      c.M = M, c.out = 512, c.in = 2048, c.split = 256, c.nvfp4 = true, c.path = Path::kDispatch;
      v.push_back(c);
    }
    for (int rows : {8, 200}) {  // several dequantise + GEMM passes, the last one partial; f32 logits
      DenseCase c;
      c.M = 260, c.out = 1000, c.in = 256, c.nvfp4 = true, c.path = Path::kDispatch, c.scratch_rows = rows;
      c.ld_pad = rows == 8 ? 8 : 0;
      v.push_back(c);
      c.f32_out = true;
      v.push_back(c);
    }
  }
  // Naive kernel and odd widths (in % 32 != 0 falls back to it).
  for (bool fp8 : {true, false}) {
    DenseCase c;
    c.M = 3, c.out = 192, c.in = 96, c.fp8 = fp8, c.path = Path::kNaive;
    v.push_back(c);
    c.in = 80, c.out = 40, c.path = Path::kSmall;
    if (!fp8) v.push_back(c);
  }
  // Dispatcher: small M and cuBLASLt sizes, both weight types, split FP8 weight.
  for (int M : {0, 1, 64, 65, 100, 256, 1000})
    for (bool fp8 : {true, false}) {
      DenseCase c;
      c.M = M, c.out = 512, c.in = 2048, c.fp8 = fp8, c.path = Path::kDispatch;
      v.push_back(c);
    }
  for (int M : {33, 66, 67}) {  // token counts that are not multiples of 4: cuBLASLt head + small-M tail
    DenseCase c;
    c.M = M, c.out = 512, c.in = 2048, c.path = Path::kDispatch;
    v.push_back(c);
    c.out = 384, c.split = 192;  // a split weight through cuBLASLt (two halves)
    v.push_back(c);
  }
  for (int M : {65, 300}) {
    DenseCase c;
    c.M = M, c.out = 384, c.in = 128, c.split = 192, c.path = Path::kDispatch;
    v.push_back(c);
    c.out = 192, c.in = 192, c.split = 0;
    v.push_back(c);
    c.fp8 = false, c.f32_out = true, c.out = 1000, c.in = 256;
    v.push_back(c);
  }
  return v;
}

std::string dense_name(const ::testing::TestParamInfo<DenseCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Dense, Dense, ::testing::ValuesIn(dense_cases()), dense_name);

std::vector<DenseCase> dense_sanitize_cases() {
  std::vector<DenseCase> v;
  DenseCase c;
  c.M = 3, c.out = 384, c.in = 128, c.split = 192;
  v.push_back(c);
  c.M = 17, c.out = 200, c.in = 160, c.split = 0, c.fp8 = false, c.ld_pad = 8;
  v.push_back(c);
  c.M = 70, c.out = 192, c.in = 192, c.fp8 = true, c.ld_pad = 0, c.path = Path::kDispatch;
  v.push_back(c);
  DenseCase n;
  n.M = 5, n.out = 200, n.in = 160, n.split = 72, n.nvfp4 = true;
  v.push_back(n);
  n.M = 257, n.out = 192, n.in = 128, n.path = Path::kDispatch;
  v.push_back(n);
  return v;
}
INSTANTIATE_TEST_SUITE_P(SanitizeDense, Dense, ::testing::ValuesIn(dense_sanitize_cases()), dense_name);

// Every e4m3 code (NaN codes excepted) through the small-M kernel's in-register decode, exactly:
// row r of the weight holds code r in column 0, x = e0, scale 1, f32 output.
TEST(DenseFp8Decode, AllCodesExact) {
  MOELORA_REQUIRE_GPU();
  const int out = 256, in = 128;
  std::vector<uint8_t> q(out * in, 0);
  for (int r = 0; r < out; ++r) q[r * in] = static_cast<uint8_t>(r);
  std::vector<float> scale(2, 1.0f);
  DeviceArray<uint8_t> dq(q);
  DeviceArray<float> ds(scale);
  DevMat x(1, in);
  x.host[0] = 1.0f;
  x.upload();
  DeviceArray<float> y(out);
  cuda::DenseArgs a;
  a.x = x.ptr();
  a.ld_x = in;
  a.M = 1;
  a.w = cuda::DenseWeight{dq.get(), cuda::WeightType::kFP8E4M3, out, in, ds.get()};
  a.y_f32 = y.get();
  a.ld_y = out;
  cuda::launch_dense_small_m(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = y.download();
  for (int r = 0; r < out; ++r) {
    if ((r & 0x7f) == 0x7f) continue;  // NaN codes: weights never hold them
    EXPECT_EQ(got[r], fp8e4m3_to_f32(static_cast<uint8_t>(r))) << "code " << r;
  }
}

}  // namespace
}  // namespace moelora::ops_test

namespace moelora::ops_test {
namespace {

// Every e2m1 code in every position of a lane's 32-value run, under every e4m3 group scale, through
// the small-M kernel's byte-permutation decode: row r has scale byte r on both groups and code
// (r + k) % 16 at column k; token t is the one-hot x = e_t, so y[t][r] is one product, exact in
// f32 (global scale 1).
TEST(DenseNvfp4Decode, AllCodesPositionsAndScalesExact) {
  MOELORA_REQUIRE_GPU();
  const int out = 256, in = 32, M = 32;
  std::vector<uint8_t> q(out * in / 2), sc(out * in / 16);
  for (int r = 0; r < out; ++r) {
    for (int k = 0; k < in; ++k) q[r * in / 2 + k / 2] |= static_cast<uint8_t>(((r + k) % 16) << (4 * (k % 2)));
    sc[r * 2] = sc[r * 2 + 1] = static_cast<uint8_t>(r);
  }
  std::vector<uint8_t> packed(q.size());
  cuda_plan::nvfp4_pack_codes(q.data(), out, in, packed.data());
  DeviceArray<uint8_t> dq(packed), ds(sc);
  DeviceArray<float> dg(std::vector<float>(out, cuda_plan::kNvfp4GlobalFactor));
  DevMat x(M, in);
  for (int t = 0; t < M; ++t) x.host[t * in + t] = 1.0f;
  x.upload();
  DeviceArray<float> y(static_cast<size_t>(M) * out);
  cuda::DenseArgs a;
  a.x = x.ptr();
  a.ld_x = in;
  a.M = M;
  a.w.w = dq.get();
  a.w.type = cuda::WeightType::kNvfp4;
  a.w.out = out;
  a.w.in = in;
  a.w.group_scale = ds.get();
  a.w.global_scale = dg.get();
  a.y_f32 = y.get();
  a.ld_y = out;
  cuda::launch_dense_small_m(a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = y.download();
  int bad = 0;
  for (int r = 0; r < out; ++r) {
    if ((r & 0x7f) == 0x7f) continue;  // NaN scale codes: loaders refuse them
    for (int t = 0; t < M; ++t) {
      const float want = fp4e2m1_to_f32(static_cast<uint8_t>((r + t) % 16)) * fp8e4m3_to_f32(static_cast<uint8_t>(r));
      if (got[t * out + r] != want && ++bad <= 10)
        ADD_FAILURE() << "scale " << r << " position " << t << ": " << got[t * out + r] << " != " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace moelora::ops_test
