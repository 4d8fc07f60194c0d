// Router top-k on the GPU against cpu::topk_softmax / cpu::topk_sigmoid_grouped: ids must match
// exactly (ties -> lower expert index, DeepSeek group masking to 0.0), weights to f32 rounding.
#include <algorithm>
#include <string>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "backends/cuda/kernels/moe_align.cuh"
#include "backends/cuda/kernels/router.cuh"
#include "tests/ops/op_suite.h"

namespace moelora::ops_test {
namespace {

struct RouterCase {
  int T, E, k;
  bool grouped = false;
  bool renorm = true;
  int n_group = 1, topk_group = 1;
  float scaling = 1.0f;
  bool ties = false;   // logits drawn from {0, 1, 2, 3}: many exact ties
  bool fused = false;  // routed inside moe_align (the decode path) instead of the router kernel
  std::string name() const {
    std::string n = grouped ? "ROUTER_GROUPED" : "ROUTER_SOFTMAX";
    n += "(T=" + std::to_string(T) + ",E=" + std::to_string(E) + ",k=" + std::to_string(k);
    if (grouped) n += ",groups=" + std::to_string(n_group) + ",topk_group=" + std::to_string(topk_group) +
                      ",scale=" + std::to_string(scaling).substr(0, 4);
    n += renorm ? ",renorm" : ",raw";
    if (ties) n += ",ties";
    if (fused) n += ",fused";
    return n + ")";
  }
};

class Router : public ::testing::TestWithParam<RouterCase> {};

TEST_P(Router, MatchesCpu) {
  MOELORA_REQUIRE_GPU();
  const RouterCase c = GetParam();
  Rng rng(seed_of(c.name()));
  std::vector<float> logits(static_cast<size_t>(c.T) * c.E), bias(c.E);
  for (auto& v : logits) v = c.ties ? static_cast<float>(rng.integer(0, 3)) : rng.normal(2.0f);
  // Bias steers selection only; quarter steps keep exact ties possible in the ties cases.
  for (auto& v : bias) v = c.ties ? 0.25f * rng.integer(-2, 2) : rng.normal(0.1f);

  std::vector<int32_t> ref_ids(static_cast<size_t>(c.T) * c.k);
  std::vector<float> ref_w(ref_ids.size());
  if (c.grouped)
    cpu::topk_sigmoid_grouped(logits.data(), bias.data(), c.T, c.E, c.k, c.n_group, c.topk_group, c.renorm, c.scaling,
                              ref_ids.data(), ref_w.data());
  else
    cpu::topk_softmax(logits.data(), c.T, c.E, c.k, c.renorm, ref_ids.data(), ref_w.data());

  DeviceArray<float> d_logits(logits), d_bias(bias);
  DeviceArray<int32_t> d_ids(ref_ids.size());
  DeviceArray<float> d_w(ref_ids.size());
  d_ids.poison(0xFF);
  d_w.poison(0xFF);
  cuda::RouterParams p;
  p.logits = d_logits.get();
  p.bias = d_bias.get();
  p.T = c.T;
  p.E = c.E;
  p.k = c.k;
  p.mode = c.grouped ? cuda::RouterMode::kSigmoidGrouped : cuda::RouterMode::kSoftmax;
  p.renormalize = c.renorm;
  p.n_group = c.n_group;
  p.topk_group = c.topk_group;
  p.scaling = c.scaling;
  p.ids = d_ids.get();
  p.weights = d_w.get();
  if (c.fused) {
    const int P = c.T * c.k;
    DeviceArray<int32_t> sorted(std::max(P, 1)), counters(cuda::kMoeNumCounters);
    const int max_tiles = cuda::moe_max_tiles(P, c.E, 8);
    DeviceArray<cuda::MoeTile> tiles(std::max(max_tiles, 1));
    DeviceArray<int32_t> tile_pairs(static_cast<size_t>(std::max(max_tiles, 1)) * 8);
    cuda::MoeAlignParams a;
    a.route = p;
    a.ids = d_ids.get();
    a.T = c.T;
    a.k = c.k;
    a.E = c.E;
    a.tile_rows = 8;
    a.sorted = sorted.get();
    a.tile_pairs = tile_pairs.get();
    a.tiles = tiles.get();
    a.max_tiles = max_tiles;
    a.counters = counters.get();
    cuda::moe_align(a, nullptr);
  } else {
    cuda::router_topk(p, nullptr);
  }
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto ids = d_ids.download();
  const auto w = d_w.download();
  int id_mismatch = 0;
  double worst = 0.0;
  for (size_t i = 0; i < ref_ids.size(); ++i) {
    if (ids[i] != ref_ids[i] && id_mismatch++ < 5)
      ADD_FAILURE() << "token " << i / c.k << " slot " << i % c.k << ": id " << ids[i] << " expected " << ref_ids[i];
    // f32 softmax against the f64 reference: a few ulp of the probabilities.
    worst = std::max(worst, std::fabs(static_cast<double>(w[i]) - ref_w[i]) / std::max(1e-6, std::fabs(double(ref_w[i]))));
  }
  EXPECT_EQ(id_mismatch, 0);
  EXPECT_LE(worst, 2e-5) << "weights";
  EXPECT_TRUE(d_ids.guard_intact() && d_w.guard_intact());
}

std::vector<RouterCase> router_cases() {
  std::vector<RouterCase> v;
  // Softmax (Qwen3-MoE, Mixtral): fixture sizes, Qwen3 sizes, E not a multiple of 32, large k.
  v.push_back({0, 8, 2});
  v.push_back({1, 8, 2});
  v.push_back({5, 8, 2, false, false});
  v.push_back({7, 128, 8});
  v.push_back({64, 128, 8, false, false});
  v.push_back({257, 128, 8});
  v.push_back({33, 64, 4, false, true, 1, 1, 1.0f, true});
  v.push_back({13, 512, 8});
  v.push_back({3, 1000, 32});
  v.push_back({1, 128, 8, false, true, 1, 1, 1.0f, false, true});
  v.push_back({64, 128, 8, false, false, 1, 1, 1.0f, true, true});
  // DeepSeek grouped: tiny (E 8, 2 groups, keep 1) and V3 (E 256, 8 groups, keep 4, scale 2.5).
  v.push_back({5, 8, 2, true, true, 2, 1, 1.0f});
  v.push_back({16, 8, 2, true, true, 2, 1, 1.0f, true});
  v.push_back({9, 256, 8, true, true, 8, 4, 2.5f});
  v.push_back({4, 256, 8, true, false, 8, 4, 2.5f});
  v.push_back({300, 256, 8, true, true, 8, 4, 2.5f});
  v.push_back({40, 256, 8, true, true, 8, 4, 2.5f, true});
  v.push_back({3, 8, 6, true, true, 2, 1, 1.0f});  // k > experts in the kept group: masked 0.0 choices win
  v.push_back({64, 256, 8, true, true, 8, 4, 2.5f, false, true});
  v.push_back({17, 8, 2, true, true, 2, 1, 1.0f, true, true});
  return v;
}

std::string router_test_name(const ::testing::TestParamInfo<RouterCase>& i) { return gtest_safe(i.param.name(), /*trim_trailing=*/false); }

INSTANTIATE_TEST_SUITE_P(Moe, Router, ::testing::ValuesIn(router_cases()), router_test_name);

// The compute-sanitizer subset (memcheck / racecheck): both rules, both paths, small.
std::vector<RouterCase> router_sanitize_cases() {
  return {{5, 8, 2}, {9, 256, 8, true, true, 8, 4, 2.5f}, {7, 128, 8, false, true, 1, 1, 1.0f, false, true},
          {6, 8, 2, true, true, 2, 1, 1.0f, true, true}};
}
INSTANTIATE_TEST_SUITE_P(MoeSanitize, Router, ::testing::ValuesIn(router_sanitize_cases()), router_test_name);

}  // namespace
}  // namespace moelora::ops_test
