// The logit processors through the engine (CPU backend, the bundled tiny model): each control
// changes the generated tokens the way its definition says, and penalised requests still do not
// depend on what shares their batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "engine_test_util.h"

namespace moelora::testing {
namespace {

TEST(EngineSampling, LogitBiasForcesAToken) {
  auto engine = make_engine(small_options(2));
  SamplingParams s = greedy(6);
  s.ignore_eos = true;
  const Outcome plain = run_alone(*engine, test_prompt(12, 1), "", s);
  const int32_t forced = (plain.tokens[0] + 7) % 200 + 1;
  s.logit_bias = {{forced, 100.0f}};
  const Outcome biased = run_alone(*engine, test_prompt(12, 1), "", s);
  for (int32_t t : biased.tokens) EXPECT_EQ(t, forced);
}

TEST(EngineSampling, AllowedTokenIdsRestrictEverySampledToken) {
  auto engine = make_engine(small_options(2));
  SamplingParams s;
  s.temperature = 1.0f, s.seed = 3, s.max_tokens = 12, s.ignore_eos = true;
  s.allowed_token_ids = {5, 17, 42};
  const Outcome o = run_alone(*engine, test_prompt(10, 2), "", s);
  ASSERT_EQ(o.tokens.size(), 12u);
  for (int32_t t : o.tokens) EXPECT_TRUE(t == 5 || t == 17 || t == 42) << t;
}

TEST(EngineSampling, BadWordsAreNeverCompleted) {
  auto engine = make_engine(small_options(2));
  SamplingParams s = greedy(8);
  s.ignore_eos = true;
  const Outcome plain = run_alone(*engine, test_prompt(12, 4), "", s);
  s.bad_words = {{plain.tokens[0]}, {plain.tokens[1], plain.tokens[2]}};
  const Outcome o = run_alone(*engine, test_prompt(12, 4), "", s);
  for (size_t i = 0; i < o.tokens.size(); ++i) {
    EXPECT_NE(o.tokens[i], plain.tokens[0]);
    if (i > 0 && o.tokens[i - 1] == plain.tokens[1]) EXPECT_NE(o.tokens[i], plain.tokens[2]);
  }
}

TEST(EngineSampling, FrequencyPenaltyBreaksRepetition) {
  auto engine = make_engine(small_options(2));
  SamplingParams s = greedy(24);
  s.ignore_eos = true;
  auto distinct = [](std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    return std::unique(v.begin(), v.end()) - v.begin();
  };
  const Outcome plain = run_alone(*engine, test_prompt(8, 5), "", s);
  s.frequency_penalty = 2.0f;
  s.presence_penalty = 2.0f;
  const Outcome penalised = run_alone(*engine, test_prompt(8, 5), "", s);
  EXPECT_GT(distinct(penalised.tokens), distinct(plain.tokens));
}

TEST(EngineSampling, MinTokensHoldsBackStopTokens) {
  auto engine = make_engine(small_options(2));
  SamplingParams s = greedy(10);
  const Outcome plain = run_alone(*engine, test_prompt(12, 6), "", s);
  ASSERT_FALSE(plain.tokens.empty());
  s.stop_token_ids = {plain.tokens[0]};  // would stop at once
  s.min_tokens = 5;
  const Outcome o = run_alone(*engine, test_prompt(12, 6), "", s);
  EXPECT_GE(o.tokens.size(), 5u);
  for (size_t i = 0; i < 4 && i < o.tokens.size(); ++i) EXPECT_NE(o.tokens[i], plain.tokens[0]);
}

TEST(EngineSampling, PenalisedSeededRequestIsIndependentOfTheBatch) {
  auto engine = make_engine(small_options(2));
  SamplingParams s;
  s.temperature = 0.8f, s.top_k = 40, s.top_p = 0.9f, s.seed = 99, s.max_tokens = 14, s.ignore_eos = true;
  s.repetition_penalty = 1.3f, s.frequency_penalty = 0.4f, s.logit_bias = {{3, 2.0f}};
  const Outcome alone = run_alone(*engine, test_prompt(16, 7), "", s);
  Collector c(*engine);
  SamplingParams other = s;
  other.seed.reset();
  other.repetition_penalty = 1.0f;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(c.submit(fmt::format("n{}", i), test_prompt(11, 50 + i), "", other).ok());
  ASSERT_TRUE(c.submit("mine", test_prompt(16, 7), "", s).ok());
  c.wait();
  EXPECT_EQ(c.get("mine").tokens, alone.tokens);
}

// Penalised requests give the same tokens whether their counts stay in the backend's penalty
// slots (the default), in edits sent every step (no slots), or some of each (one slot for five
// penalised requests: the first takes it, the others fall back), with unpenalised requests mixed in;
// slots are given back when requests end (a second round can take them again).
TEST(EngineSampling, PenaltySlotsGiveTheSameTokensAsHostCounts) {
  auto run_all = [](int penalty_slots, bool penalties = true) {
    EngineOptions o = small_options(2);
    o.penalty_slots = penalty_slots;
    auto engine = make_engine(o);
    std::map<std::string, std::vector<int32_t>> out;
    for (int round = 0; round < 2; ++round) {
      Collector c(*engine);
      for (int i = 0; i < 6; ++i) {
        SamplingParams s;
        s.temperature = 0.9f, s.top_p = 0.9f, s.seed = 100 + i, s.max_tokens = 12 + i, s.ignore_eos = true;
        if (i != 3 && penalties) {
          s.repetition_penalty = i % 2 ? 2.0f : 1.0f;
          s.frequency_penalty = i % 3 == 0 ? 1.5f : 0.0f;
          s.presence_penalty = i == 4 ? -2.0f : 1.5f;
          if (i == 5) s.logit_bias = {{9, 1.5f}}, s.min_tokens = 4;
        }
        const std::string id = fmt::format("r{}-{}", round, i);
        EXPECT_TRUE(c.submit(id, test_prompt(10 + 3 * i, 20 + i), "", s).ok());
      }
      c.wait();
      for (int i = 0; i < 6; ++i) {
        const std::string id = fmt::format("r{}-{}", round, i);
        out[id] = c.get(id).tokens;
      }
    }
    expect_no_leaks(*engine);
    return out;
  };
  const auto host = run_all(0);
  EXPECT_EQ(run_all(-1), host);
  EXPECT_EQ(run_all(1), host);
  // The penalties do change these requests' tokens (else the comparison above could not fail).
  const auto unpenalised = run_all(-1, false);
  int changed = 0;
  for (const auto& [id, toks] : host) changed += toks != unpenalised.at(id);
  EXPECT_GE(changed, 8);  // of the 10 penalised requests
}

// Penalised requests keep their slot through preemption (a KV cache too small for all of them:
// recomputed requests still give the tokens of a roomy engine without slots), give it back when
// cancelled mid-generation, and the stats say how many are held.
TEST(EngineSampling, PenaltySlotsSurvivePreemptionAndAreFreedOnCancel) {
  EngineOptions roomy = small_options(2), tiny = small_options(2);
  roomy.kv_page_size = tiny.kv_page_size = 4;
  roomy.penalty_slots = 0;
  tiny.kv_num_pages = 24;  // one request needs up to 13 pages: requests are preempted and recomputed
  auto ref = make_engine(roomy);
  auto engine = make_engine(tiny);
  EXPECT_EQ(engine->stats().penalty_slots_total, 16);
  Collector want(*ref), got(*engine);
  auto params = [](int i) {
    SamplingParams s;
    s.temperature = 0.8f, s.seed = 7 + i, s.max_tokens = 36, s.ignore_eos = true;
    s.repetition_penalty = 1.8f, s.frequency_penalty = i % 2 ? 1.0f : 0.0f, s.presence_penalty = 0.5f;
    return s;
  };
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(want.submit(fmt::format("r{}", i), test_prompt(12 + i, 60 + i), "", params(i)).ok());
    ASSERT_TRUE(got.submit(fmt::format("r{}", i), test_prompt(12 + i, 60 + i), "", params(i)).ok());
  }
  SamplingParams long_one = params(9);
  long_one.max_tokens = 60;  // 70 positions: inside the 96 the cache holds
  ASSERT_TRUE(got.submit("cancelled", test_prompt(10, 99), "", long_one).ok());
  ASSERT_TRUE(got.wait_for_tokens("cancelled", 3, 30000));
  EXPECT_GE(engine->stats().penalty_slots_used, 1);
  engine->cancel("cancelled");
  want.wait();
  got.wait();
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(got.get(fmt::format("r{}", i)).tokens, want.get(fmt::format("r{}", i)).tokens) << "request " << i;
  EXPECT_EQ(got.get("cancelled").final.reason, FinishReason::kCancelled);
  EXPECT_GT(engine->stats().num_preemptions_total, 0u) << "the cache was meant to be too small for all at once";
  expect_no_leaks(*engine);
}

TEST(EngineSampling, OutOfRangeControlsAreRefused) {
  auto engine = make_engine(small_options(2));
  SamplingParams s = greedy(4);
  s.logit_bias = {{1 << 30, 1.0f}};
  Collector c(*engine);
  const Status st = c.submit("bad", test_prompt(5, 1), "", s);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("logit_bias"), std::string::npos);
}

}  // namespace
}  // namespace moelora::testing
