// Op suite: device token choice (sampling.cuh). The CPU reference is written here (cpu_ops has
// none): greedy argmax with ties to the lower index and log-softmax in f64; Gumbel-max with the
// same Philox draws (philox_uniform is host/device code).
#include <cmath>

#include "backends/cuda/kernels/sampling.cuh"
#include "tests/ops/dense_test_util.h"

namespace moelora::ops_test {
namespace {

// logprob = x_id / T - logsumexp(x / T): f32 online log-sum-exp over <= 152k terms against f64;
// relative 1e-6 of a value ~12 is ~1e-5 absolute; 1e-4 leaves margin.
constexpr double kLogprobAbs = 1e-4;

struct SampleCase {
  int rows = 3, vocab = 1000;
  float temp = 0.0f;
  bool specials = false;  // ties, -inf, NaN entries
  std::string name() const {
    char t[32];
    std::snprintf(t, sizeof(t), "%.2f", temp);
    return "SAMPLE(rows=" + std::to_string(rows) + ",vocab=" + std::to_string(vocab) +
           (temp > 0 ? std::string(",temp=") + t : std::string(",greedy")) + (specials ? ",specials" : "") + ")";
  }
};

void PrintTo(const SampleCase& c, std::ostream* os) { *os << c.name(); }

class Sample : public ::testing::TestWithParam<SampleCase> {};

TEST_P(Sample, MatchesReference) {
  MOELORA_REQUIRE_GPU();
  const SampleCase c = GetParam();
  Rng rng(seed_of(c.name()));
  const int ld = c.vocab + 4;
  std::vector<float> x(static_cast<size_t>(c.rows) * ld, 0.0f);
  for (int r = 0; r < c.rows; ++r)
    for (int i = 0; i < c.vocab; ++i) x[r * ld + i] = rng.normal(3.0f);
  if (c.specials && c.rows > 0) {
    x[0 * ld + 5] = x[0 * ld + 9] = 50.0f;  // a tie: the lower index wins
    if (c.rows > 1) {
      x[1 * ld + 0] = NAN;
      x[1 * ld + 1] = -INFINITY;
    }
  }
  std::vector<float> temp(c.rows, c.temp);
  std::vector<uint64_t> seed(c.rows), step(c.rows);
  for (int r = 0; r < c.rows; ++r) seed[r] = 0x1234567890ull + 977 * r, step[r] = 3 + r;
  DeviceArray<float> dx(x), dt(temp), dmax(c.rows), dlp(c.rows);
  DeviceArray<uint64_t> ds(seed), dst(step);
  DeviceArray<int32_t> ids(c.rows);
  cuda::SampleParams p;
  p.logits = dx.get(), p.ld = ld, p.rows = c.rows, p.vocab = c.vocab;
  p.temperature = dt.get(), p.seed = ds.get(), p.step = dst.get();
  p.ids = ids.get(), p.max_logit = dmax.get(), p.logprob = dlp.get();
  cuda::launch_sample(p, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto gid = ids.download();
  const auto gmax = dmax.download();
  const auto glp = dlp.download();
  for (int r = 0; r < c.rows; ++r) {
    const float* row = &x[r * ld];
    const double inv_t = c.temp > 0 ? 1.0 / c.temp : 1.0;
    int best = -1;
    double bkey = -INFINITY, m = -INFINITY;
    std::vector<double> keys(c.vocab, -INFINITY);
    for (int i = 0; i < c.vocab; ++i) {
      if (std::isnan(row[i])) continue;
      const float z = static_cast<float>(row[i] * static_cast<float>(inv_t));
      m = std::max(m, static_cast<double>(z));
      keys[i] = c.temp > 0 ? z - std::log(-std::log(cuda::philox_uniform(seed[r], step[r], i))) : row[i];
      if (best < 0 || keys[i] > bkey) best = i, bkey = keys[i];
    }
    double sum = 0.0;
    for (int i = 0; i < c.vocab; ++i)
      if (!std::isnan(row[i])) sum += std::exp(row[i] * inv_t - m);
    const int id = gid[r];
    if (id != best) {
      // Only a near-tie of Gumbel keys may differ (device logf vs host log, last bits).
      ASSERT_GE(id, 0);
      ASSERT_LT(id, c.vocab);
      EXPECT_NEAR(keys[id], bkey, 1e-5 * std::max(1.0, std::fabs(bkey))) << "row " << r;
    }
    EXPECT_EQ(gmax[r], row[id]);
    EXPECT_NEAR(glp[r], row[id] * inv_t - (m + std::log(sum)), kLogprobAbs) << "row " << r;
  }
  EXPECT_TRUE(ids.guard_intact() && dmax.guard_intact() && dlp.guard_intact());
}

std::vector<SampleCase> sample_cases() {
  return {{0, 100}, {1, 151936}, {7, 1000, 0.0f, true}, {256, 4096}, {5, 151936, 0.7f}, {64, 1000, 1.3f, true}};
}
std::string sample_name(const ::testing::TestParamInfo<SampleCase>& i) { return gtest_safe(i.param.name()); }
INSTANTIATE_TEST_SUITE_P(Sample, Sample, ::testing::ValuesIn(sample_cases()), sample_name);
INSTANTIATE_TEST_SUITE_P(SanitizeSample, Sample, ::testing::Values(SampleCase{3, 1000, 0.0f, true}, SampleCase{2, 600, 0.9f}),
                         sample_name);

// Gumbel-max draws follow softmax(x / T): 20000 rows of the same 6 logits, steps 0..19999.
TEST(SampleDistribution, FollowsSoftmax) {
  MOELORA_REQUIRE_GPU();
  const int rows = 20000, V = 6;
  const float T = 0.8f;
  const float logits[V] = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.5f};
  std::vector<float> x(static_cast<size_t>(rows) * V);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < V; ++i) x[r * V + i] = logits[i];
  std::vector<float> temp(rows, T);
  std::vector<uint64_t> seed(rows, 42), step(rows);
  for (int r = 0; r < rows; ++r) step[r] = r;
  DeviceArray<float> dx(x), dt(temp);
  DeviceArray<uint64_t> ds(seed), dst(step);
  DeviceArray<int32_t> ids(rows);
  cuda::SampleParams p;
  p.logits = dx.get(), p.ld = V, p.rows = rows, p.vocab = V;
  p.temperature = dt.get(), p.seed = ds.get(), p.step = dst.get(), p.ids = ids.get();
  cuda::launch_sample(p, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int> count(V, 0);
  for (int id : ids.download()) ++count[id];
  double z = 0.0;
  for (int i = 0; i < V; ++i) z += std::exp(logits[i] / T);
  for (int i = 0; i < V; ++i) {
    const double pr = std::exp(logits[i] / T) / z;
    const double sd = std::sqrt(rows * pr * (1 - pr));
    EXPECT_NEAR(count[i], rows * pr, 4 * sd) << "token " << i;  // 4 sigma: a false alarm ~1e-4
  }
}

}  // namespace
}  // namespace moelora::ops_test
