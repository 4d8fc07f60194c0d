// The sampling spec on the CPU (cpu::sample, the reference of Backend::sample) and the host half
// that builds its rows (runtime/sampler.h): distributions against independently computed
// probabilities, batch independence, every logit processor's math, and validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_ops.h"
#include "runtime/sampler.h"

namespace moelora {
namespace {

SampleRow row_of(float t, int k = 0, float p = 1.0f, float min_p = 0.0f) {
  SampleRow r;
  r.temperature = t, r.top_k = k, r.top_p = p, r.min_p = min_p;
  return r;
}

// Draws `n` tokens from one row of logits at steps 0..n-1 and counts them.
std::vector<int> histogram(const std::vector<float>& logits, SampleRow r, int n) {
  const int V = static_cast<int>(logits.size());
  std::vector<float> many(static_cast<size_t>(n) * V);
  std::vector<SampleRow> rows(n, r);
  for (int s = 0; s < n; ++s) {
    std::copy(logits.begin(), logits.end(), many.begin() + static_cast<size_t>(s) * V);
    rows[s].seed = 99;
    rows[s].step = s;
  }
  std::vector<int> count(V, 0);
  for (const SampleOutput& o : cpu::sample(many.data(), V, V, rows)) ++count[o.token];
  return count;
}

// Each count within 4.5 standard deviations of n * prob (a false alarm is ~1e-5 per token).
void expect_follows(const std::vector<int>& count, const std::vector<double>& prob, int n) {
  for (size_t i = 0; i < prob.size(); ++i) {
    const double sd = std::sqrt(n * prob[i] * (1 - prob[i]));
    if (prob[i] == 0) EXPECT_EQ(count[i], 0) << "token " << i;
    else EXPECT_NEAR(count[i], n * prob[i], 4.5 * sd + 1e-9) << "token " << i;
  }
}

const std::vector<float> kLogits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.5f, -1.0f, 0.7f};

std::vector<double> softmax(const std::vector<float>& x, float t, const std::vector<bool>& keep) {
  std::vector<double> p(x.size(), 0.0);
  double z = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (keep[i]) z += p[i] = std::exp(x[i] / static_cast<double>(t));
  for (double& q : p) q /= z;
  return p;
}

TEST(SamplerSpec, TemperatureFollowsSoftmax) {
  const int n = 20000;
  expect_follows(histogram(kLogits, row_of(0.8f), n), softmax(kLogits, 0.8f, std::vector<bool>(8, true)), n);
}

TEST(SamplerSpec, TopKKeepsTheKBest) {
  const int n = 20000;
  // The 3 best: ids 3 (2.0), 5 (1.5), 0 (1.0).
  std::vector<bool> keep(8, false);
  keep[3] = keep[5] = keep[0] = true;
  expect_follows(histogram(kLogits, row_of(1.0f, 3), n), softmax(kLogits, 1.0f, keep), n);
}

TEST(SamplerSpec, TopPKeepsTheShortestPrefixReachingP) {
  const int n = 20000;
  const std::vector<double> full = softmax(kLogits, 1.0f, std::vector<bool>(8, true));
  // Sorted: 3, 5, 0, 7, 1, 4, 2, 6. Find the prefix independently.
  const int order[8] = {3, 5, 0, 7, 1, 4, 2, 6};
  std::vector<bool> keep(8, false);
  double cum = 0;
  for (int i : order) {
    keep[i] = true;
    cum += full[i];
    if (cum >= 0.75) break;
  }
  expect_follows(histogram(kLogits, row_of(1.0f, 0, 0.75f), n), softmax(kLogits, 1.0f, keep), n);
}

TEST(SamplerSpec, MinPDropsTokensBelowTheFractionOfTheBest) {
  const int n = 20000;
  std::vector<bool> keep(8);
  for (int i = 0; i < 8; ++i) keep[i] = std::exp(kLogits[i] - 2.0) >= 0.3;
  expect_follows(histogram(kLogits, row_of(1.0f, 0, 1.0f, 0.3f), n), softmax(kLogits, 1.0f, keep), n);
}

TEST(SamplerSpec, GreedyIsTheArgmaxWithLowestIdOnTies) {
  std::vector<float> x = {0.5f, 3.0f, -1.0f, 3.0f};
  const auto out = cpu::sample(x.data(), 4, 4, {row_of(0.0f)});
  EXPECT_EQ(out[0].token, 1);
  double z = 0;
  for (float v : x) z += std::exp(static_cast<double>(v));
  EXPECT_NEAR(out[0].logprob, 3.0 - std::log(z), 1e-6);
}

TEST(SamplerSpec, TopLogprobsAreTheRawDistributionsBest) {
  std::vector<float> x = {0.5f, 3.0f, -1.0f, 3.0f, 2.0f};
  SampleRow r = row_of(0.0f);
  r.logprobs = 3;
  r.restrict_to_allowed = true;  // processing changes the choice, never the reported distribution
  LogitEdit e;
  e.token = 2, e.allowed = 1;
  r.edits = {e};
  const auto out = cpu::sample(x.data(), 5, 5, {r});
  EXPECT_EQ(out[0].token, 2);
  ASSERT_EQ(out[0].top_logprobs.size(), 3u);
  EXPECT_EQ(out[0].top_logprobs[0].first, 1);
  EXPECT_EQ(out[0].top_logprobs[1].first, 3);
  EXPECT_EQ(out[0].top_logprobs[2].first, 4);
}

TEST(SamplerSpec, TokenDependsOnlyOnItsRowSeedAndStep) {
  std::mt19937 g(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const int V = 500;
  std::vector<float> mine(V);
  for (float& v : mine) v = nd(g);
  SampleRow r = row_of(1.0f, 0, 0.9f);
  r.seed = 77, r.step = 12;
  const int alone = cpu::sample(mine.data(), V, V, {r})[0].token;
  for (int trial = 0; trial < 5; ++trial) {
    const int rows = 2 + trial, at = trial % rows;
    std::vector<float> batch(static_cast<size_t>(rows) * V);
    std::vector<SampleRow> rs(rows, row_of(0.7f, 5));
    for (int i = 0; i < rows; ++i) {
      rs[i].seed = 1000 + trial * 10 + i;
      for (int j = 0; j < V; ++j) batch[i * V + j] = nd(g);
    }
    std::copy(mine.begin(), mine.end(), batch.begin() + static_cast<size_t>(at) * V);
    rs[at] = r;
    EXPECT_EQ(cpu::sample(batch.data(), V, V, rs)[at].token, alone);
  }
}

// The draw: 53 uniform bits per (seed, step) scaled to an integer below the kept mass. Checks
// the scaling's range and exactness at its ends, and that the bits are uniform enough that the
// targets spread evenly over 16 equal slices of [0, total).
TEST(SamplerSpec, DrawTargetIsAUniformIntegerBelowTheTotal) {
  const uint64_t top = (uint64_t{1} << 53) - 1;
  for (uint64_t total : {uint64_t{1}, uint64_t{3}, uint64_t{1} << 32, (uint64_t{1} << 50) - 7}) {
    EXPECT_EQ(sampling::draw_target(0, total), 0u);
    EXPECT_EQ(sampling::draw_target(top, total), total - 1) << total;
    EXPECT_LT(sampling::draw_target(top / 2, total), total);
  }
  const uint64_t total = uint64_t{3} << 40;
  std::vector<int> slice(16, 0);
  const int n = 32000;
  for (int s = 0; s < n; ++s) {
    const uint64_t bits = sampling::draw_bits(12345, static_cast<uint64_t>(s));
    ASSERT_LT(bits, uint64_t{1} << 53);
    const uint64_t t = sampling::draw_target(bits, total);
    ASSERT_LT(t, total);
    ++slice[static_cast<size_t>(t / (total / 16))];
  }
  const double sd = std::sqrt(n * (1.0 / 16) * (15.0 / 16));
  for (int c : slice) EXPECT_NEAR(c, n / 16.0, 4.5 * sd);
  EXPECT_NE(sampling::draw_bits(1, 0), sampling::draw_bits(2, 0));
  EXPECT_NE(sampling::draw_bits(1, 0), sampling::draw_bits(1, 1));
}

// A non-finite logit has no mass: +inf tokens are never drawn while a finite token exists, and a
// row of only +inf / NaN / -inf values gives the first token of its order (the best, lowest id:
// the contract's "no mass" case).
TEST(SamplerSpec, NonFiniteLogitsHaveNoMass) {
  std::vector<float> x = {INFINITY, 0.0f, 1.0f, INFINITY, -INFINITY, NAN, 0.5f};
  const std::vector<int> count = histogram(x, row_of(1.0f), 4000);
  EXPECT_EQ(count[0] + count[3] + count[4] + count[5], 0);
  expect_follows(count, softmax(x, 1.0f, {false, true, true, false, false, false, true}), 4000);
  std::vector<float> none = {NAN, INFINITY, -INFINITY, INFINITY};
  EXPECT_EQ(cpu::sample(none.data(), 4, 4, {row_of(1.0f, 0, 0.9f)})[0].token, 1);
}

// key_value inverts order_key on every finite value and the infinities.
TEST(SamplerSpec, KeyValueInvertsOrderKey) {
  for (float v : {0.0f, 1.0f, -1.0f, 3.5e-39f, -3.5e-39f, 1e30f, -1e30f, INFINITY, -INFINITY, 0.1f})
    EXPECT_EQ(sampling::key_value(sampling::order_key(v)), v == 0.0f ? 0.0f : v);
  EXPECT_TRUE(std::isnan(sampling::key_value(0u)));
}

TEST(SamplerSpec, EditMathFollowsVllm) {
  LogitEdit e;
  e.in_context = 1;
  EXPECT_FLOAT_EQ(sampling::apply_edit(2.0f, e, 0, 0, 2.0f), 1.0f);    // positive: divided
  EXPECT_FLOAT_EQ(sampling::apply_edit(-2.0f, e, 0, 0, 2.0f), -4.0f);  // negative: multiplied
  e.out_count = 3;
  EXPECT_FLOAT_EQ(sampling::apply_edit(1.0f, e, 0.2f, 0.5f, 1.0f), 1.0f - (0.5f * 3 + 0.2f));
  LogitEdit b;
  b.bias = -100.0f;
  EXPECT_FLOAT_EQ(sampling::apply_edit(5.0f, b, 0, 0, 1.0f), -95.0f);
  b.banned = 1;
  EXPECT_EQ(sampling::apply_edit(5.0f, b, 0, 0, 1.0f), -INFINITY);
}

const LogitEdit* find_edit(const SampleRow& r, int32_t t) {
  for (const LogitEdit& e : r.edits)
    if (e.token == t) return &e;
  return nullptr;
}

TEST(SampleRowBuilder, ProcessorsBecomeSortedEdits) {
  SamplingParams p;
  p.temperature = 0.5f, p.top_k = 7, p.seed = 5;
  p.logit_bias = {{9, 3.5f}, {2, -1.0f}};
  p.repetition_penalty = 1.2f;
  p.frequency_penalty = 0.1f;
  p.min_tokens = 3;
  p.stop_token_ids = {11};
  p.bad_words = {{4}, {6, 7}, {8, 5, 9}};
  const std::vector<int32_t> tokens = {1, 2, 3, /*generated:*/ 6, 3};
  SampleRow r = make_sample_row(p, 5, tokens, 3, {0}, 100);
  EXPECT_EQ(r.step, 2u);
  EXPECT_EQ(r.seed, 5u);
  EXPECT_TRUE(std::is_sorted(r.edits.begin(), r.edits.end(), [](auto& a, auto& b) { return a.token < b.token; }));
  EXPECT_FLOAT_EQ(find_edit(r, 9)->bias, 3.5f);
  EXPECT_TRUE(find_edit(r, 0)->banned);   // EOS before min_tokens
  EXPECT_TRUE(find_edit(r, 11)->banned);  // stop id before min_tokens
  EXPECT_TRUE(find_edit(r, 4)->banned);   // one-token bad word
  EXPECT_EQ(find_edit(r, 7), nullptr);    // "6 7": the output ends with 3, not 6
  EXPECT_TRUE(find_edit(r, 1)->in_context);  // prompt token: repetition penalty
  EXPECT_EQ(find_edit(r, 1)->out_count, 0);
  EXPECT_EQ(find_edit(r, 3)->out_count, 1);  // generated once (and in the prompt)
  EXPECT_EQ(find_edit(r, 6)->out_count, 1);

  const std::vector<int32_t> later = {1, 2, 3, 6, 3, 5, 6};
  SampleRow r2 = make_sample_row(p, 5, later, 3, {0}, 100);
  EXPECT_TRUE(find_edit(r2, 7)->banned);  // now ends with 6
  EXPECT_TRUE(find_edit(r2, 0) == nullptr || !find_edit(r2, 0)->banned);  // min_tokens reached
}

// The engine keeps the penalties' counts incrementally (PenaltyCounts); every step's row must be
// the recount's, edit for edit, for every combination of penalties and the other processors.
TEST(SampleRowBuilder, IncrementalPenaltyCountsEqualTheRecountEveryStep) {
  std::mt19937 g(21);
  for (int combo = 0; combo < 8; ++combo) {
    SamplingParams p;
    p.repetition_penalty = (combo & 1) ? 1.3f : 1.0f;
    p.frequency_penalty = (combo & 2) ? 0.2f : 0.0f;
    p.presence_penalty = (combo & 4) ? -0.5f : 0.0f;
    p.logit_bias = {{5, 1.0f}, {40, -2.0f}, {63, 0.5f}};
    p.min_tokens = 4;
    p.stop_token_ids = {7};
    p.bad_words = {{9}, {3, 12}};
    std::vector<int32_t> tokens(30);
    for (auto& t : tokens) t = std::uniform_int_distribution<int>(0, 63)(g);
    const int prompt_len = static_cast<int>(tokens.size());
    PenaltyCounts counts;
    for (int step = 0; step < 60; ++step) {
      counts.sync(p, tokens, prompt_len);
      const SampleRow a = make_sample_row(p, 3, tokens, prompt_len, {0}, 64);
      const SampleRow b = make_sample_row(p, 3, tokens, prompt_len, {0}, 64, counts);
      ASSERT_EQ(a.edits.size(), b.edits.size()) << "combo " << combo << " step " << step;
      for (size_t i = 0; i < a.edits.size(); ++i) {
        const LogitEdit &x = a.edits[i], &y = b.edits[i];
        ASSERT_TRUE(x.token == y.token && x.bias == y.bias && x.out_count == y.out_count &&
                    x.in_context == y.in_context && x.banned == y.banned && x.allowed == y.allowed)
            << "combo " << combo << " step " << step << " edit " << i << " token " << x.token;
      }
      EXPECT_EQ(a.step, b.step);
      tokens.push_back(std::uniform_int_distribution<int>(0, 63)(g));  // the token "sampled"
    }
  }
}

// A row with a penalty slot samples with its own edits merged with the slot's cells
// (penalty_slot_edits): with the cells a reset made and the sampler's counting after each drawn
// token, those are the recount's edits, edit for edit, at every step, for every mix of penalties,
// with and without allowed_token_ids.
TEST(SampleRowBuilder, PenaltySlotRowsEqualTheRecountEveryStep) {
  std::mt19937 g(33);
  constexpr int V = 64;
  for (int combo = 0; combo < 16; ++combo) {
    SamplingParams p;
    p.repetition_penalty = (combo & 1) ? 0.7f : 1.0f;
    p.frequency_penalty = (combo & 2) ? -0.3f : 0.0f;
    p.presence_penalty = (combo & 4) ? 1.5f : 0.0f;
    if (combo & 8) p.allowed_token_ids = {1, 5, 9, 40, 63};
    p.logit_bias = {{5, 1.0f}, {40, -2.0f}, {62, 0.5f}};
    p.min_tokens = 3;
    p.stop_token_ids = {7};
    p.bad_words = {{9}, {3, 12}};
    std::vector<int32_t> tokens(25);
    for (auto& t : tokens) t = std::uniform_int_distribution<int>(0, V - 1)(g);
    const int prompt_len = 20;  // the last 5 were generated before the slot was taken
    std::vector<uint32_t> cells(V);
    penalty_reset_cells(cells.data(), V, tokens, prompt_len);
    for (int step = 0; step < 40; ++step) {
      const SampleRow want = make_sample_row(p, 3, tokens, prompt_len, {0}, V);
      const SampleRow row = make_slot_sample_row(p, 3, tokens, prompt_len, {0}, V, /*penalty_slot=*/2);
      EXPECT_EQ(row.penalty_slot, 2);
      const std::vector<LogitEdit> got = penalty_slot_edits(row, cells.data(), V);
      ASSERT_EQ(got.size(), want.edits.size()) << "combo " << combo << " step " << step;
      for (size_t i = 0; i < got.size(); ++i) {
        const LogitEdit &x = want.edits[i], &y = got[i];
        ASSERT_TRUE(x.token == y.token && x.bias == y.bias && x.out_count == y.out_count &&
                    x.in_context == y.in_context && x.banned == y.banned && x.allowed == y.allowed)
            << "combo " << combo << " step " << step << " edit " << i << " token " << x.token;
      }
      EXPECT_EQ(row.step, want.step);
      EXPECT_EQ(row.restrict_to_allowed, want.restrict_to_allowed);
      const int32_t drawn = std::uniform_int_distribution<int>(0, V - 1)(g);
      tokens.push_back(drawn);
      cells[drawn] = penalty_count(cells[drawn], /*generated=*/true);
    }
  }
}

// The CPU backend's slots: a penalised row drawn from slot 1 gives the recount row's token, and
// the backend counts each drawn token itself, over a run of steps (other slots untouched).
TEST(SampleRowBuilder, CpuBackendPenaltySlotsSampleAsTheRecount) {
  constexpr int V = 300;
  CpuBackend backend;
  backend.reserve_penalty_slots(3, V);
  ASSERT_EQ(backend.penalty_slots(), 3);
  SamplingParams p;
  p.temperature = 0.9f, p.top_p = 0.95f, p.repetition_penalty = 1.4f, p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f, p.logit_bias = {{11, 3.0f}};
  std::mt19937 g(5);
  std::vector<int32_t> tokens(40);
  for (auto& t : tokens) t = std::uniform_int_distribution<int>(0, 59)(g);  // a narrow prompt: many repeats
  const int prompt_len = 40;
  backend.penalty_reset(1, tokens, prompt_len);
  Tensor logits = Tensor::empty_host(DType::kF32, {1, V});
  std::vector<float> raw(V);
  for (int step = 0; step < 30; ++step) {
    std::normal_distribution<float> n(0.0f, 2.0f);
    for (int t = 0; t < V; ++t) raw[t] = n(g) + (t < 60 ? 3.0f : 0.0f);  // the prompt's tokens are likely
    std::copy(raw.begin(), raw.end(), logits.ptr<float>());
    const SampleRow want = make_sample_row(p, 77, tokens, prompt_len, {}, V);
    const int32_t ref = cpu::sample(raw.data(), V, V, {want})[0].token;
    const SampleRow row = make_slot_sample_row(p, 77, tokens, prompt_len, {}, V, 1);
    const int32_t got = backend.sample(logits, {row})[0].token;
    ASSERT_EQ(got, ref) << "step " << step;
    tokens.push_back(got);
  }
  // A reset replaces what a slot counted. Greedy logits where an in-context token t0 leads a fresh
  // token t1 by less than the repetition penalty takes off: slot 0 counting the context gives t1,
  // the same slot reset to nothing gives t0 (the row without counts).
  const int32_t t0 = tokens[0];
  int32_t t1 = V - 1;
  while (std::find(tokens.begin(), tokens.end(), t1) != tokens.end()) --t1;
  std::fill(raw.begin(), raw.end(), -10.0f);
  raw[t0] = 5.0f, raw[t1] = 4.0f;  // 5 / 1.4 < 4
  std::copy(raw.begin(), raw.end(), logits.ptr<float>());
  SamplingParams greedy_rep;
  greedy_rep.temperature = 0.0f, greedy_rep.repetition_penalty = 1.4f;
  SampleRow on_slot0 = make_slot_sample_row(greedy_rep, 1, tokens, prompt_len, {}, V, /*penalty_slot=*/0);
  backend.penalty_reset(0, tokens, prompt_len);
  EXPECT_EQ(backend.sample(logits, {on_slot0})[0].token, t1);
  backend.penalty_reset(0, {}, 0);
  EXPECT_EQ(backend.sample(logits, {on_slot0})[0].token, t0);
}

// Backend::sample's preconditions (check_sample_rows, shared by every backend) refuse rows that
// would sample differently on the two backends or race on the device: unsorted or duplicated
// edits, edits outside the vocabulary, two rows counting into one penalty slot.
TEST(SampleRowBuilder, SampleRowsBreakingThePreconditionsAreRefused) {
  constexpr int V = 50;
  CpuBackend backend;
  backend.reserve_penalty_slots(2, V);
  Tensor logits = Tensor::empty_host(DType::kF32, {2, V});
  std::fill(logits.ptr<float>(), logits.ptr<float>() + 2 * V, 0.0f);
  auto edit = [](int32_t t) {
    LogitEdit e;
    e.token = t, e.bias = 1.0f;
    return e;
  };
  std::vector<SampleRow> rows(2);
  rows[0].edits = {edit(3), edit(9)};
  rows[1].penalty_slot = 1;
  EXPECT_EQ(backend.sample(logits, rows).size(), 2u);  // the valid form first
  std::vector<SampleRow> unsorted = rows;
  unsorted[0].edits = {edit(9), edit(3)};
  EXPECT_DEATH(backend.sample(logits, unsorted), "edit 1 is token 3; edits are sorted by token");
  std::vector<SampleRow> twice = rows;
  twice[0].edits = {edit(3), edit(3)};
  EXPECT_DEATH(backend.sample(logits, twice), "edit 1 is token 3;.*one per token");
  std::vector<SampleRow> outside = rows;
  outside[0].edits = {edit(3), edit(V)};
  EXPECT_DEATH(backend.sample(logits, outside), "edit 1 is token 50;.*below 50");
  std::vector<SampleRow> shared = rows;
  shared[0].penalty_slot = 1;
  EXPECT_DEATH(backend.sample(logits, shared), "share penalty slot 1");
}

TEST(SampleRowBuilder, AllowedTokensRestrictTheChoice) {
  SamplingParams p;
  p.allowed_token_ids = {3, 7};
  std::vector<float> x(10, 0.0f);
  x[1] = 50.0f;
  for (int step = 0; step < 50; ++step) {
    SampleRow r = make_sample_row(p, 17, std::vector<int32_t>(1 + step, 1), 1, {}, 10);
    EXPECT_TRUE(r.restrict_to_allowed);
    const int t = cpu::sample(x.data(), 10, 10, {r})[0].token;
    EXPECT_TRUE(t == 3 || t == 7) << t;
  }
}

TEST(SampleRowBuilder, ValidationNamesTheField) {
  SamplingParams p;
  EXPECT_TRUE(validate_sampling(p, 100).ok());
  auto msg = [](SamplingParams q) { return validate_sampling(q, 100).message(); };
  SamplingParams q = p;
  q.presence_penalty = 2.5f;
  EXPECT_NE(msg(q).find("presence_penalty"), std::string::npos);
  q = p, q.repetition_penalty = 0.0f;
  EXPECT_NE(msg(q).find("repetition_penalty"), std::string::npos);
  q = p, q.min_tokens = 17;
  EXPECT_NE(msg(q).find("min_tokens"), std::string::npos);
  q = p, q.logit_bias = {{100, 1.0f}};
  EXPECT_NE(msg(q).find("logit_bias"), std::string::npos);
  q = p, q.logit_bias = {{1, 101.0f}};
  EXPECT_NE(msg(q).find("logit_bias"), std::string::npos);
  q = p, q.allowed_token_ids = {-1};
  EXPECT_NE(msg(q).find("allowed_token_ids"), std::string::npos);
  q = p, q.bad_words = {{1, 200}};
  EXPECT_NE(msg(q).find("bad_words"), std::string::npos);
  q = p, q.logprobs = 21;
  EXPECT_NE(msg(q).find("logprobs"), std::string::npos);
}

}  // namespace
}  // namespace moelora
