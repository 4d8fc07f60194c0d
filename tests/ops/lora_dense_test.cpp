// Op suite: multi-adapter dense LoRA (lora_dense.cuh) against cpu::lora_add.
// Every case builds `slots` adapters with their own ranks (0 = module missing), per-token slots
// with -1 mixed in, several projections sharing one launch, and checks: rows of base-only tokens
// (and of rank-0 problems) are bit-identical to the base output, every other row matches the
// reference, the padding of strided outputs and the guard regions are untouched.
#include <memory>

#include "backends/cuda/kernels/lora_dense.cuh"
#include "core/tensor.h"
#include "gpukit/dense.h"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// Segmented kernel: u kept to ~16 bits (bf16 hi + lo), f32 accumulation, one bf16 rounding of
// y = base + delta: 4e-3 row-relative, as every single-rounding op.
constexpr double kSegmented = 4e-3;
// cuBLAS single-adapter path: u is stored in bf16 between the two GEMMs (2^-9 relative on the
// delta, which the cases make as large as the base output) plus the final rounding: 8e-3.
constexpr double kSingleGemm = 8e-3;

struct LoraCase {
  std::string label;  // what the case is about
  int T = 7, slots = 4;
  std::vector<int> outs{192};
  int in = 128;
  std::string ranks = "mixed";  // "mixed" (1..128) or a single number
  std::string tokens = "random";  // random (with -1) | distinct | single:<slot> | single-1:<slot>
  bool graph = false;
  std::string name() const {
    std::string o;
    for (size_t i = 0; i < outs.size(); ++i) o += (i ? "+" : "") + std::to_string(outs[i]);
    return "LORA_DENSE(T=" + std::to_string(T) + ",slots=" + std::to_string(slots) + ",in=" + std::to_string(in) +
           ",out=" + o + ",r=" + (ranks == "mixed" ? std::string("1..128,mixed") : ranks) + ",tokens=" + tokens +
           (graph ? ",graph" : "") + (label.empty() ? "" : "," + label) + ")";
  }
};

struct Adapter {
  std::vector<float> a, b;  // [r, in], [out, r] (bf16 values)
  DeviceArray<uint16_t> da, db;
};

void PrintTo(const LoraCase& c, std::ostream* os) { *os << c.name(); }

class LoraDense : public ::testing::TestWithParam<LoraCase> {};

TEST_P(LoraDense, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const LoraCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int P = static_cast<int>(c.outs.size());
  // Slots of every token.
  std::vector<int32_t> slot(c.T);
  int single = -1;
  if (c.tokens.rfind("single", 0) == 0) single = std::stoi(c.tokens.substr(c.tokens.find(':') + 1));
  for (int t = 0; t < c.T; ++t) {
    if (c.tokens == "distinct") slot[t] = t % c.slots;
    else if (single >= 0) slot[t] = single;
    else slot[t] = rng.integer(-1, c.slots - 1);
  }
  if (c.tokens.rfind("single-1", 0) == 0 && c.T > 1) slot[c.T / 2] = -1;  // one base-only token
  // Ranks per problem and slot; slot 1 of problem 0 lacks the module (rank 0) in mixed cases.
  const int mixed[] = {1, 3, 8, 16, 17, 64, 100, 128};
  std::vector<std::vector<int>> rank(P, std::vector<int>(c.slots));
  for (int p = 0; p < P; ++p)
    for (int s = 0; s < c.slots; ++s)
      rank[p][s] = c.ranks == "mixed" ? mixed[rng.integer(0, 7)] : std::stoi(c.ranks);
  if (c.ranks == "mixed" && c.slots > 1 && single != 1) rank[0][1] = 0;

  DevMat x(c.T, c.in, c.in + 8);
  x.randomize(rng);
  std::vector<std::vector<Adapter>> ad(P);
  std::vector<DevMat> y;
  std::vector<std::vector<float>> y0(P), ref(P);
  std::vector<DeviceArray<int64_t>> dap(P), dbp(P);
  std::vector<DeviceArray<int32_t>> drk(P);
  std::vector<cuda::LoraProblem> probs(P);
  for (int p = 0; p < P; ++p) {
    const int out = c.outs[p];
    ad[p].resize(c.slots);
    std::vector<int64_t> ap(c.slots, 0), bp(c.slots, 0);
    for (int s = 0; s < c.slots; ++s) {
      const int r = rank[p][s];
      Adapter& A = ad[p][s];
      A.a = round_bf16(rng.normals(static_cast<size_t>(r) * c.in, 1.0f / std::sqrt(static_cast<float>(c.in))));
      A.b = round_bf16(rng.normals(static_cast<size_t>(out) * r, r ? 1.0f / std::sqrt(static_cast<float>(r)) : 1.0f));
      A.da = DeviceArray<uint16_t>(to_bf16(A.a));
      A.db = DeviceArray<uint16_t>(to_bf16(A.b));
      ap[s] = r ? reinterpret_cast<int64_t>(A.da.get()) : 0;
      bp[s] = r ? reinterpret_cast<int64_t>(A.db.get()) : 0;
    }
    dap[p] = DeviceArray<int64_t>(ap);
    dbp[p] = DeviceArray<int64_t>(bp);
    drk[p] = DeviceArray<int32_t>(std::vector<int32_t>(rank[p].begin(), rank[p].end()));
    y.emplace_back(c.T, out, out + 8);
    y[p].randomize(rng);
    y0[p] = y[p].host;
    // CPU reference on host copies of the same values.
    std::vector<const float*> ah, bh;
    for (const Adapter& A : ad[p]) ah.push_back(A.a.data()), bh.push_back(A.b.data());
    const LoraModuleTable tab = host_lora_table(c.in, out, ah, bh, rank[p]);
    ref[p] = y0[p];
    cpu::lora_add(x.host.data(), c.in, c.T, slot.data(), tab, ref[p].data(), out);
    probs[p] = cuda::LoraProblem{x.ptr(), x.ld, y[p].ptr(), y[p].ld, c.in, out, c.slots,
                                 dap[p].get(), dbp[p].get(), drk[p].get(), rank[p].data()};
  }

  cuda::LoraContext ctx;
  const int capacity = c.graph ? cuda::lora_max_items(std::max(c.T, 1), c.slots, P) : 0;
  // The selection rule itself, at every batch size (the default also asks for a minimum of
  // tokens, a tuning choice): the cuBLAS path exactly when one adapter and no base-only token.
  cuda::LoraPlanOptions opt;
  opt.single_adapter_min_tokens = 1;
  cuda::LoraPlan plan = cuda::lora_plan(slot.data(), c.T, probs.data(), P, opt, capacity);
  // The single-adapter path is taken exactly when the batch holds one adapter and no base token,
  // and it uses that adapter's slot (never slot 0 by default).
  bool expect_single = c.T > 0;  // one distinct adapter, no base-only token
  for (int t = 0; t < c.T; ++t) expect_single = expect_single && slot[t] >= 0 && slot[t] == slot[0];
  const int single_slot = c.T > 0 ? slot[0] : -1;
  EXPECT_EQ(plan.single_adapter, expect_single);
  if (expect_single) {
    EXPECT_EQ(plan.single_slot, single_slot);
  }
  DeviceArray<uint8_t> meta(cuda::lora_meta_bytes(plan.capacity, c.T));
  DeviceArray<uint8_t> scratch(cuda::lora_single_scratch_bytes(std::max(c.T, 1), probs.data(), P));
  // The buffers were poisoned on the legacy stream; a non-blocking stream does not wait for that.
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t st;
  MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cuda::lora_upload_plan(plan, meta.get(), meta.size(), st);
  if (c.graph) {
    ASSERT_FALSE(plan.single_adapter);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    cuda::lora_run(ctx, probs.data(), P, plan, meta.get(), {scratch.get(), scratch.size()}, st, plan.capacity);
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(st, &g));
    MOELORA_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    MOELORA_CUDA_CHECK(cudaGraphLaunch(ge, st));
    MOELORA_CUDA_CHECK(cudaStreamSynchronize(st));
    MOELORA_CUDA_CHECK(cudaGraphExecDestroy(ge));
    MOELORA_CUDA_CHECK(cudaGraphDestroy(g));
  } else {
    cuda::lora_run(ctx, probs.data(), P, plan, meta.get(), {scratch.get(), scratch.size()}, st);
  }
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(st));
  MOELORA_CUDA_CHECK(cudaStreamDestroy(st));
  for (int p = 0; p < P; ++p) {
    const std::vector<float> got = y[p].download();
    const int out = c.outs[p];
    for (int t = 0; t < c.T; ++t) {
      const bool untouched = slot[t] < 0 || rank[p][slot[t]] == 0;
      if (!untouched) continue;
      for (int n = 0; n < out; ++n)
        ASSERT_EQ(got[t * out + n], y0[p][t * out + n]) << "problem " << p << " base-only token " << t << " changed";
    }
    EXPECT_CLOSE_ROWS(got, ref[p], c.T, out, plan.single_adapter ? kSingleGemm : kSegmented);
    EXPECT_TRUE(y[p].padding_intact()) << "problem " << p;
  }
  EXPECT_TRUE(meta.guard_intact() && scratch.guard_intact());
}

std::vector<LoraCase> lora_cases() {
  std::vector<LoraCase> v;
  const std::vector<int> tiny{192, 384};       // gate, fused gate|up of the tiny models
  const std::vector<int> qkv{4096, 512, 512};  // Qwen3-30B-A3B q, k, v
  for (int T : {0, 1, 7, 33, 256}) {
    LoraCase c;
    c.T = T, c.outs = tiny;
    v.push_back(c);
    c.outs = qkv, c.in = 2048;
    if (T != 256) v.push_back(c);
  }
  {
    LoraCase c;  // largest captured batch, Qwen q/k/v, graph replay with spare capacity
    c.T = 256, c.slots = 8, c.outs = qkv, c.in = 2048, c.graph = true;
    v.push_back(c);
    c.T = 5, c.slots = 4, c.outs = tiny, c.in = 128;
    v.push_back(c);
  }
  {
    LoraCase c;  // every token on a different adapter
    c.T = 64, c.slots = 64, c.tokens = "distinct", c.outs = {2048}, c.in = 4096, c.ranks = "16";
    v.push_back(c);
    c.outs = tiny, c.in = 128, c.ranks = "mixed";
    v.push_back(c);
  }
  for (int r : {1, 16, 64, 128}) {
    LoraCase c;
    c.T = 9, c.slots = 3, c.ranks = std::to_string(r), c.outs = {4096, 512}, c.in = 2048;
    v.push_back(c);
  }
  // Single adapter in slot 2 (slot 0 holds a different adapter): the cuBLAS path.
  for (int T : {1, 40, 256}) {
    LoraCase c;
    c.T = T, c.slots = 4, c.tokens = "single:2", c.outs = qkv, c.in = 2048;
    v.push_back(c);
    c.outs = tiny, c.in = 128, c.tokens = "single:3";
    v.push_back(c);
  }
  {
    LoraCase c;  // one adapter but a base-only token too: the segmented path
    c.T = 40, c.slots = 4, c.tokens = "single-1:2", c.outs = qkv, c.in = 2048;
    v.push_back(c);
  }
  {
    LoraCase c;  // in not a multiple of 128 (partial K block), odd outs
    c.T = 11, c.in = 96, c.outs = {200, 40, 8};
    v.push_back(c);
  }
  // Inputs that are multiples of 8 but not of the shrink's 32-value run: the 8-value pieces past
  // the end read nothing (a model of hidden 80, head dims 80 / 48, expert intermediate 144).
  for (int T : {1, 7, 64, 300}) {
    LoraCase c;
    c.T = T, c.in = 80, c.outs = {320, 160, 96};
    v.push_back(c);
  }
  {
    LoraCase c;
    c.T = 33, c.in = 144, c.outs = {80};
    v.push_back(c);
    c.T = 5, c.in = 8, c.outs = {16, 24}, c.ranks = "16";
    v.push_back(c);
    c.T = 256, c.in = 208, c.outs = {208}, c.ranks = "mixed", c.tokens = "single:2";  // cuBLAS path
    v.push_back(c);
    c.T = 9, c.in = 40, c.outs = {96}, c.tokens = "random", c.graph = true;
    v.push_back(c);
  }
  return v;
}

std::string lora_name(const ::testing::TestParamInfo<LoraCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Lora, LoraDense, ::testing::ValuesIn(lora_cases()), lora_name);

std::vector<LoraCase> lora_sanitize_cases() {
  std::vector<LoraCase> v;
  LoraCase c;
  c.T = 9, c.slots = 4, c.outs = {192, 384}, c.in = 128;
  v.push_back(c);
  c.in = 512, c.outs = {256, 64};  // a 4-block cluster exchanging partial sums
  v.push_back(c);
  c.T = 6, c.tokens = "single:2", c.outs = {192}, c.in = 128;
  v.push_back(c);
  c.T = 5, c.tokens = "random", c.graph = true, c.in = 256;
  v.push_back(c);
  c.T = 7, c.graph = false, c.in = 80, c.outs = {320, 96};  // pieces past a 32-value run's end
  v.push_back(c);
  return v;
}
INSTANTIATE_TEST_SUITE_P(SanitizeLora, LoraDense, ::testing::ValuesIn(lora_sanitize_cases()), lora_name);

}  // namespace
}  // namespace moelora::ops_test
