// Op suite: Backend::sample on the device (cuda_sampler.cu + kernels/sampling.cu) against the CPU
// reference (cpu::sample), row by row: the same token, the same top-logprob ids, logprobs within
// kLogprobAbs. The contract (ops/backend.h) makes every decision with exact integer masses or
// single correctly rounded double operations; the only allowed difference is a device exp/log
// ulp right at a decision boundary, which these random cases do not hit (a mismatch fails).
#include <algorithm>
#include <bit>
#include <cmath>
#include <map>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/kernels/sampling.cuh"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

// logprob = x_id - logsumexp(x): the device sums f32 exps in f64 over <= 152k terms against the
// reference's f64 exps; ~1e-6 relative of |logprob| ~ 12 is ~1e-5; 1e-4 leaves margin.
constexpr double kLogprobAbs = 1e-4;

// kPeaked: a few strong tokens over a broad normal tail (a trained model); kFlat: normal sd 0.3 (a
// random-weight model: top-p keeps most of the row, so the kernel's sparse passes select most tokens);
// kCoarse: the peaked logits rounded to multiples of 0.5 (thousands of tokens tied at every key, the
// top-k / top-p boundary inside a large tie, so the id passes run on many tokens); kFewFinite: 30
// finite tokens, the rest -inf (top-k 50 is larger than the finite set); kFlatOutlier: kFlat with one
// token 40 below (the bins span 24 T, so thousands of tokens share a bin and its sub-bins are
// used); kInfinite: kPeaked with three +inf tokens (first in the order, no mass).
enum class Logits { kPeaked, kFlat, kCoarse, kFewFinite, kFlatOutlier, kInfinite };

struct SampleCase {
  std::string label;
  int rows = 4, vocab = 1000;
  SampleRow row;            // every row gets these parameters, with its own seed and step
  bool specials = false;    // ties, -inf and NaN entries
  bool edits = false;       // bias, bans and penalties on random tokens
  bool allowed = false;     // restrict_to_allowed to 40 random tokens
  Logits logits = Logits::kPeaked;
  std::string name() const { return "SAMPLE(" + label + ",rows=" + std::to_string(rows) + ",vocab=" + std::to_string(vocab) + ")"; }
};

void PrintTo(const SampleCase& c, std::ostream* os) { *os << c.name(); }

SampleRow params(float t, int k = 0, float p = 1.0f, float min_p = 0.0f, int logprobs = 0) {
  SampleRow r;
  r.temperature = t, r.top_k = k, r.top_p = p, r.min_p = min_p, r.logprobs = logprobs;
  return r;
}

// Logits like a language model's: a few strong tokens over a broad normal tail (other kinds: Logits).
std::vector<float> make_logits(Rng& rng, int rows, int vocab, int64_t ld, Logits kind = Logits::kPeaked) {
  std::vector<float> x(static_cast<size_t>(rows) * ld, 0.0f);
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + static_cast<size_t>(r) * ld;
    if (kind == Logits::kFlat || kind == Logits::kFlatOutlier) {
      for (int i = 0; i < vocab; ++i) row[i] = rng.normal(0.3f);
      if (kind == Logits::kFlatOutlier) row[rng.integer(0, vocab - 1)] = -40.0f;
      continue;
    }
    if (kind == Logits::kFewFinite) {
      for (int i = 0; i < vocab; ++i) row[i] = -INFINITY;
      for (int j = 0; j < 30; ++j) row[rng.integer(0, vocab - 1)] = rng.normal(2.0f);
      continue;
    }
    for (int i = 0; i < vocab; ++i) row[i] = rng.normal(2.0f);
    for (int j = 0; j < 8; ++j) row[rng.integer(0, vocab - 1)] += rng.uniform(4.0f, 12.0f);
    if (kind == Logits::kCoarse)
      for (int i = 0; i < vocab; ++i) row[i] = std::round(row[i] * 2.0f) * 0.5f;
    if (kind == Logits::kInfinite)
      for (int j = 0; j < 3; ++j) row[rng.integer(0, vocab - 1)] = INFINITY;
  }
  return x;
}

std::vector<SampleRow> make_rows(const SampleCase& c, Rng& rng) {
  std::vector<SampleRow> rows;
  for (int r = 0; r < c.rows; ++r) {
    SampleRow row = c.row;
    row.seed = 0x9E3779B97F4A7C15ull * (r + 1);
    row.step = static_cast<uint64_t>(rng.integer(0, 5000));
    std::map<int32_t, LogitEdit> e;
    if (c.edits) {
      row.presence = 0.5f, row.frequency = 0.3f, row.repetition = 1.3f;
      for (int j = 0; j < 60; ++j) {
        LogitEdit& x = e[rng.integer(0, c.vocab - 1)];
        const int kind = rng.integer(0, 3);
        if (kind == 0) x.bias = rng.uniform(-100.0f, 100.0f);
        if (kind == 1) x.banned = 1;
        if (kind == 2) x.in_context = 1;
        if (kind == 3) x.in_context = 1, x.out_count = rng.integer(1, 5);
      }
    }
    if (c.allowed) {
      row.restrict_to_allowed = true;
      for (int j = 0; j < 40; ++j) e[rng.integer(0, c.vocab - 1)].allowed = 1;
    }
    for (auto& [t, x] : e) {
      x.token = t;
      row.edits.push_back(x);
    }
    rows.push_back(row);
  }
  return rows;
}

class Sample : public ::testing::TestWithParam<SampleCase> {};

TEST_P(Sample, MatchesReference) {
  MOELORA_REQUIRE_GPU();
  const SampleCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int64_t ld = c.vocab + 4;
  std::vector<float> x = make_logits(rng, c.rows, c.vocab, ld, c.logits);
  if (c.specials) {
    x[5] = x[9] = 80.0f;                   // a tie at the top: the lower id is first
    if (c.rows > 1) x[ld + 0] = NAN, x[ld + 1] = -INFINITY;
    if (c.rows > 2)
      for (int i = 0; i < c.vocab; ++i) x[2 * ld + i] = 1.0f;  // all tied
    if (c.rows > 3)
      for (int i = 0; i < c.vocab; ++i) x[3 * ld + i] = -INFINITY;
  }
  const std::vector<SampleRow> rows = make_rows(c, rng);
  const std::vector<SampleOutput> want = cpu::sample(x.data(), ld, c.vocab, rows);

  DeviceArray<float> dx(x);
  Tensor logits = Tensor(dx.get(), DType::kF32, {c.rows, ld}, Device::kCuda).slice_cols(0, c.vocab);
  CudaBackend backend(CudaBackendOptions{.arena_bytes = 64 << 20});
  const std::vector<SampleOutput> got = backend.sample(logits, rows);
  ASSERT_EQ(got.size(), want.size());
  for (int r = 0; r < c.rows; ++r) {
    EXPECT_EQ(got[r].token, want[r].token) << "row " << r;
    if (std::isfinite(want[r].logprob)) {
      EXPECT_NEAR(got[r].logprob, want[r].logprob, kLogprobAbs) << "row " << r;
    }
    ASSERT_EQ(got[r].top_logprobs.size(), want[r].top_logprobs.size()) << "row " << r;
    for (size_t j = 0; j < want[r].top_logprobs.size(); ++j) {
      EXPECT_EQ(got[r].top_logprobs[j].first, want[r].top_logprobs[j].first) << "row " << r << " rank " << j;
      if (std::isfinite(want[r].top_logprobs[j].second)) {
        EXPECT_NEAR(got[r].top_logprobs[j].second, want[r].top_logprobs[j].second, kLogprobAbs);
      }
    }
  }
  EXPECT_TRUE(dx.guard_intact());
}

std::vector<SampleCase> sample_cases() {
  const int kQwen = 151936;
  return {
      {"greedy", 1, kQwen, params(0.0f)},
      {"greedy-logprobs", 7, 1000, params(0.0f, 0, 1.0f, 0.0f, 5), true},
      {"temp", 64, 4096, params(0.8f)},
      {"temp-qwen", 5, kQwen, params(1.0f, 0, 1.0f, 0.0f, 20)},
      {"topk1", 8, 1000, params(1.0f, 1)},
      {"topk50", 16, kQwen, params(0.7f, 50)},
      {"topk-specials", 6, 1000, params(1.0f, 20), true},
      {"topp0.9", 32, kQwen, params(1.0f, 0, 0.9f)},
      {"topp0.5-specials", 6, 1000, params(1.2f, 0, 0.5f), true},
      {"topp0.99-hot", 8, 32000, params(2.0f, 0, 0.99f)},
      {"topk-topp-minp", 16, kQwen, params(0.9f, 100, 0.95f, 0.05f, 3)},
      {"minp", 8, 4096, params(1.0f, 0, 1.0f, 0.2f)},
      {"edits-greedy", 8, 4096, params(0.0f, 0, 1.0f, 0.0f, 2), false, true},
      {"edits-topp", 8, kQwen, params(1.0f, 40, 0.8f), false, true},
      {"allowed", 8, 4096, params(1.0f, 0, 0.9f), false, true, true},
      {"allowed-greedy", 4, 1000, params(0.0f), false, false, true},
      {"many-rows", 256, 4096, params(1.0f, 0, 0.95f, 0.0f, 1)},
      // Row counts on both sides of the backend's cluster-size steps (cuda_plan::choose_sample_cluster).
      {"topp-40rows", 40, kQwen, params(0.8f, 0, 0.9f, 0.0f, 2)},
      {"topk-topp-100rows", 100, 32000, params(1.0f, 64, 0.9f)},
      {"topp-300rows", 300, 4096, params(0.7f, 0, 0.8f, 0.0f, 4), true, true},
      // The sparse passes (for_row_sparse) with most of the row selected, with large ties at the
      // boundary (the id passes), and with top-k larger than the finite tokens.
      {"topp-flat", 8, kQwen, params(0.8f, 0, 0.9f), false, false, false, Logits::kFlat},
      {"topk-topp-logprobs-flat", 8, kQwen, params(0.8f, 50, 0.9f, 0.0f, 5), false, false, false, Logits::kFlat},
      {"topp-edits-flat", 6, kQwen, params(0.8f, 0, 0.95f, 0.0f, 2), false, true, false, Logits::kFlat},
      {"topp-coarse-ties", 8, kQwen, params(0.8f, 0, 0.9f, 0.0f, 3), false, false, false, Logits::kCoarse},
      {"topk-coarse-ties", 8, 32000, params(1.0f, 50, 1.0f, 0.0f, 5), false, false, false, Logits::kCoarse},
      {"topk-topp-coarse-ties", 6, 32000, params(0.7f, 300, 0.6f, 0.0f, 1), true, true, false, Logits::kCoarse},
      {"topk-over-finite", 6, 32000, params(1.0f, 50, 0.9f, 0.0f, 3), false, false, false, Logits::kFewFinite},
      {"topp-few-finite-minp", 6, kQwen, params(0.9f, 0, 0.99f, 0.1f, 4), true, false, false, Logits::kFewFinite},
      // The binned selection's sub-bins (thousands of tokens in one bin), +inf tokens (no mass;
      // top-k 1 keeps only one, so the first token is returned), a zero top-p (the first token
      // alone), and temperatures that make the bins span 24 T or the whole row.
      {"topp-flat-outlier", 8, kQwen, params(0.8f, 0, 0.9f, 0.0f, 2), false, false, false, Logits::kFlatOutlier},
      {"temp-flat-outlier", 4, kQwen, params(1.0f), false, false, false, Logits::kFlatOutlier},
      {"topk-topp-infinite", 6, 32000, params(0.9f, 50, 0.9f, 0.0f, 3), false, false, false, Logits::kInfinite},
      {"topk1-infinite", 4, 4096, params(1.0f, 1), false, false, false, Logits::kInfinite},
      {"minp-infinite", 4, 4096, params(1.0f, 0, 1.0f, 0.3f), false, false, false, Logits::kInfinite},
      {"topp0", 4, 4096, params(1.0f, 0, 0.0f)},
      {"topp-cold", 8, kQwen, params(0.05f, 0, 0.9f)},
      {"topp-hot-flat", 8, kQwen, params(20.0f, 0, 0.95f), false, false, false, Logits::kFlat},
  };
}
std::string sample_name(const ::testing::TestParamInfo<SampleCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Sample, Sample, ::testing::ValuesIn(sample_cases()), sample_name);
INSTANTIATE_TEST_SUITE_P(SanitizeSample, Sample,
                         ::testing::Values(SampleCase{"san", 4, 600, params(0.9f, 10, 0.8f, 0.0f, 3), true, true}),
                         sample_name);

// The kernel's results are bit-identical for every cluster size (ops/backend.h: a row's sample does
// not depend on the batch; the backend picks the size from the number of rows): the same rows
// launched with 2, 4, 8 and 16 blocks per row give byte-equal outputs, logprobs included.
TEST(SampleCluster, EveryClusterSizeGivesTheSameBytes) {
  MOELORA_REQUIRE_GPU();
  Rng rng(11);
  const int V = 151936, R = 16;
  const int64_t ld = V;
  std::vector<float> x = make_logits(rng, 12, V, ld);
  for (int i = 0; i < V; i += 97) x[2 * ld + i] = 30.0f;  // a row of many ties at the top
  // Rows 12, 13 flat (top-p keeps most of the row), 14, 15 coarse (large ties at every boundary).
  for (const Logits kind : {Logits::kFlat, Logits::kCoarse}) {
    const std::vector<float> more = make_logits(rng, 2, V, ld, kind);
    x.insert(x.end(), more.begin(), more.end());
  }
  std::vector<cuda::DeviceSampleRow> rows(R);
  for (int r = 0; r < R; ++r) {
    cuda::DeviceSampleRow& d = rows[r];
    d = cuda::DeviceSampleRow{};
    d.temperature = r % 4 == 0 ? 0.0f : 0.6f + 0.1f * (r % 5);
    d.top_p = r % 3 == 0 ? 1.0f : 0.5f + 0.04f * r;
    d.top_k = r % 4 == 1 ? 40 : 0;
    d.min_p = r % 6 == 5 ? 0.02f : 0.0f;
    d.repetition = 1.0f;
    d.logprobs = r % 5;
    d.seed = 0x9E3779B97F4A7C15ull * (r + 1), d.step = static_cast<uint64_t>(r * 131);
    d.processed = -1;
  }
  DeviceArray<float> dx(x);
  DeviceArray<cuda::DeviceSampleRow> dparams(rows);
  std::vector<std::vector<uint8_t>> got;
  const std::array<int, 5> active = cuda::sample_max_active_clusters();
  for (int c : {2, 4, 8, 16}) {
    if (active[std::countr_zero(static_cast<unsigned>(c))] == 0) continue;  // a size this GPU cannot run
    DeviceArray<cuda::DeviceSampleResult> out(R);
    out.poison(0);
    cuda::SampleParams p;
    p.logits = dx.get(), p.ld = ld, p.rows = R, p.vocab = V;
    p.params = dparams.get(), p.out = out.get(), p.cluster = c;
    cuda::launch_sample(p, nullptr);
    MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<cuda::DeviceSampleResult> res = out.download();
    const auto* b = reinterpret_cast<const uint8_t*>(res.data());
    got.emplace_back(b, b + res.size() * sizeof(cuda::DeviceSampleResult));
    EXPECT_TRUE(out.guard_intact()) << "cluster " << c;
  }
  ASSERT_GE(got.size(), 3u);
  for (size_t i = 1; i < got.size(); ++i) EXPECT_TRUE(got[i] == got[0]) << "cluster size #" << i << " differs from 2";
}

// Seeded streams: 4000 consecutive steps of one request under top-p give the reference's tokens.
TEST(SampleStream, SameTokensAsReferenceEveryStep) {
  MOELORA_REQUIRE_GPU();
  Rng rng(7);
  const int V = 32000, steps = 4000;
  std::vector<float> x = make_logits(rng, 1, V, V);
  std::vector<float> many(static_cast<size_t>(steps) * V);
  for (int s = 0; s < steps; ++s) std::copy(x.begin(), x.end(), many.begin() + static_cast<size_t>(s) * V);
  std::vector<SampleRow> rows(steps, params(1.0f, 0, 0.9f));
  for (int s = 0; s < steps; ++s) rows[s].seed = 1234, rows[s].step = s;
  const auto want = cpu::sample(many.data(), V, V, rows);
  DeviceArray<float> dx(many);
  CudaBackend backend(CudaBackendOptions{.arena_bytes = 64 << 20});
  const auto got = backend.sample(Tensor(dx.get(), DType::kF32, {steps, V}, Device::kCuda), rows);
  int same = 0;
  for (int s = 0; s < steps; ++s) same += got[s].token == want[s].token;
  EXPECT_EQ(same, steps);
}

// Penalty slots (ops/sampling.h): rows whose counts the backend keeps, mixed with rows that carry
// their counts as edits and rows without penalties, against the CPU backend's slots (which sample
// with penalty_slot_edits through cpu::sample) over consecutive steps: the same tokens every step,
// so the device counts each drawn token as the reference does. A slot is reset twice before one
// step (the last reset counts) and another mid-run; one row restricts to allowed tokens.
TEST(SamplePenaltySlots, SameTokensAsTheCpuBackendEveryStep) {
  MOELORA_REQUIRE_GPU();
  for (const int V : {4096, 151936}) {
    Rng rng(seed_of("penalty-slots") + V);
    const int R = 6, steps = 24;
    CudaBackend gpu(CudaBackendOptions{.arena_bytes = 64 << 20});
    CpuBackend cpu;
    gpu.reserve_penalty_slots(4, V);
    cpu.reserve_penalty_slots(4, V);
    ASSERT_EQ(gpu.penalty_slots(), 4);
    // Row r's slot (rows 4, 5 have none: row 4 carries counts as edits, row 5 has no penalty).
    const int slot_of[R] = {3, 1, 0, 2, -1, -1};
    std::vector<std::vector<int32_t>> tokens(R);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 50 + 10 * r; ++i) tokens[r].push_back(rng.integer(0, 199));  // repeats: strong counts
    for (Backend* b : std::vector<Backend*>{&gpu, &cpu}) {
      // Replaced by the next reset of slot 3 before any sample: counted as generated tokens, which row
      // 3's frequency and presence penalties read, so applying both resets would change its tokens.
      b->penalty_reset(3, {1, 2, 3}, 0);
      for (int r = 0; r < 4; ++r) b->penalty_reset(slot_of[r], tokens[r], 40);
    }
    for (int step = 0; step < steps; ++step) {
      if (step == 10) {  // slot 1 starts over with a shorter context than it counted: a lost reset shows
        tokens[1].resize(45);
        for (Backend* b : std::vector<Backend*>{&gpu, &cpu}) b->penalty_reset(1, tokens[1], 40);
      }
      std::vector<float> x = make_logits(rng, R, V, V);
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 200; ++t) x[static_cast<size_t>(r) * V + t] += 4.0f;  // the contexts' tokens compete
      std::vector<SampleRow> rows(R);
      for (int r = 0; r < R; ++r) {
        SampleRow& row = rows[r];
        row.temperature = r == 2 ? 0.0f : 0.9f, row.top_p = 0.9f, row.top_k = r == 1 ? 50 : 0, row.logprobs = r % 3;
        row.seed = 1000 + r, row.step = static_cast<uint64_t>(step);
        if (r != 5) row.repetition = r == 3 ? 1.0f : 1.6f, row.frequency = r % 2 ? 0.7f : 0.0f, row.presence = r == 0 ? -0.5f : 0.6f;
        LogitEdit bias;
        bias.token = 7 + r, bias.bias = 2.5f;
        if (r == 0) bias.allowed = 1;
        row.edits.push_back(bias);
        if (r == 0) {  // restricted to 30 tokens of the contexts, with allowed edits
          row.restrict_to_allowed = true;
          for (int t = 20; t < 50; ++t) {
            LogitEdit a;
            a.token = t, a.allowed = 1;
            row.edits.push_back(a);
          }
          std::sort(row.edits.begin(), row.edits.end(), [](const LogitEdit& a, const LogitEdit& b) { return a.token < b.token; });
        }
        row.penalty_slot = slot_of[r];
      }
      // Row 4's counts as edits (what the engine sends without a slot), merged with its bias edit.
      std::vector<uint32_t> cells4(V);
      penalty_reset_cells(cells4.data(), V, tokens[4], 40);
      rows[4].edits = penalty_slot_edits(rows[4], cells4.data(), V);
      DeviceArray<float> dx(x);
      const auto got = gpu.sample(Tensor(dx.get(), DType::kF32, {R, V}, Device::kCuda), rows);
      Tensor hx = Tensor::empty_host(DType::kF32, {R, V});
      std::copy(x.begin(), x.end(), hx.ptr<float>());
      const auto want = cpu.sample(hx, rows);
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(got[r].token, want[r].token) << "vocab " << V << " step " << step << " row " << r;
        tokens[r].push_back(got[r].token);
      }
    }
  }
}

}  // namespace
}  // namespace moelora::ops_test
