// Scheduling and memory: continuous batching, chunked prefill, preemption under a tiny KV cache,
// the adapter-keyed prefix cache, cancellation. On the CPU backend a request's output must not
// depend on what else runs (whatever shares its batch), so every comparison here is exact.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "engine_test_util.h"

namespace moelora::testing {
namespace {

TEST(EngineScheduling, MixedBatchMatchesEachRequestAlone) {
  auto engine = make_engine(small_options());
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  ASSERT_TRUE(engine->load_adapter("full-r16", adapter_dir("full-r16")).ok());
  const std::vector<std::string> adapters = {"", "attn-r8", "full-r16"};
  std::vector<Outcome> alone;
  for (int i = 0; i < 6; ++i) alone.push_back(run_alone(*engine, test_prompt(9 + 5 * i, i), adapters[i % 3], greedy(12)));
  Collector c(*engine);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(c.submit(fmt::format("r{}", i), test_prompt(9 + 5 * i, i), adapters[i % 3], greedy(12)).ok());
  c.wait();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(c.get(fmt::format("r{}", i)).tokens, alone[i].tokens) << "request " << i;
  // Adapters change the output (otherwise the comparison above proves little).
  EXPECT_NE(alone[0].tokens, run_alone(*engine, test_prompt(9, 0), "full-r16", greedy(12)).tokens);
  expect_no_leaks(*engine);
}

TEST(EngineScheduling, SeededSamplingIsIndependentOfTheBatch) {
  auto engine = make_engine(small_options());
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  SamplingParams s;
  s.temperature = 0.9f;
  s.top_p = 0.95f;
  s.seed = 1234;
  s.max_tokens = 16;
  s.ignore_eos = true;
  const Outcome alone = run_alone(*engine, test_prompt(20, 3), "attn-r8", s);
  Collector c(*engine);
  SamplingParams other = s;
  other.seed.reset();
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c.submit(fmt::format("noise{}", i), test_prompt(15, 100 + i), i % 2 ? "attn-r8" : "", other).ok());
  ASSERT_TRUE(c.submit("seeded", test_prompt(20, 3), "attn-r8", s).ok());
  c.wait();
  EXPECT_EQ(c.get("seeded").tokens, alone.tokens);
}

TEST(EngineScheduling, ChunkedPrefillGivesTheSameTokens) {
  EngineOptions big = small_options();
  EngineOptions chunked = small_options();
  chunked.max_batch_tokens = 7;  // a 60-token prompt takes 9 steps
  auto a = make_engine(big);
  auto b = make_engine(chunked);
  const auto prompt = test_prompt(60, 11);
  EXPECT_EQ(run_alone(*a, prompt, "", greedy(10)).tokens, run_alone(*b, prompt, "", greedy(10)).tokens);
}

TEST(EngineScheduling, PreemptionUnderATinyKvCacheKeepsGreedyOutput) {
  EngineOptions roomy = small_options();
  EngineOptions tiny = small_options();
  tiny.kv_page_size = 4;
  tiny.kv_num_pages = 24;  // one request needs up to 13 pages: at most one or two fit at once
  roomy.kv_page_size = 4;
  auto ref = make_engine(roomy);
  auto engine = make_engine(tiny);
  for (Engine* e : {ref.get(), engine.get()}) ASSERT_TRUE(e->load_adapter("full-r16", adapter_dir("full-r16")).ok());
  Collector want(*ref), got(*engine);
  for (int i = 0; i < 6; ++i) {
    const std::string adapter = i % 2 ? "full-r16" : "";
    ASSERT_TRUE(want.submit(fmt::format("r{}", i), test_prompt(12 + i, 40 + i), adapter, greedy(36)).ok());
    ASSERT_TRUE(got.submit(fmt::format("r{}", i), test_prompt(12 + i, 40 + i), adapter, greedy(36)).ok());
  }
  want.wait();
  got.wait();
  for (int i = 0; i < 6; ++i) {
    const Outcome w = want.get(fmt::format("r{}", i)), g = got.get(fmt::format("r{}", i));
    EXPECT_EQ(g.final.reason, FinishReason::kLength);
    EXPECT_EQ(g.tokens, w.tokens) << "request " << i;
  }
  EXPECT_GT(engine->stats().num_preemptions_total, 0u) << "the cache was meant to be too small for all at once";
  expect_no_leaks(*engine);
}

TEST(EngineScheduling, RequestLargerThanTheWholeCacheIsRefusedUpFront) {
  EngineOptions o = small_options();
  o.kv_page_size = 4;
  o.kv_num_pages = 4;
  auto engine = make_engine(o);
  Collector c(*engine);
  Status s = c.submit("big", test_prompt(10, 1), "", greedy(20));
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  expect_no_leaks(*engine);
}

TEST(EngineScheduling, PrefixCacheHitsWithinOneAdapterOnly) {
  EngineOptions o = small_options();
  o.kv_page_size = 8;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  ASSERT_TRUE(engine->load_adapter("full-r16", adapter_dir("full-r16")).ok());
  const auto prompt = test_prompt(35, 7);  // 4 full pages of 8; the cache keeps at least 1 token to compute
  const Outcome first = run_alone(*engine, prompt, "attn-r8", greedy(6));
  EXPECT_EQ(first.final.cached_tokens, 0);
  const uint64_t hits_before = engine->stats().prefix_cache_hits_total;
  const Outcome again = run_alone(*engine, prompt, "attn-r8", greedy(6));
  EXPECT_EQ(again.final.cached_tokens, 32);
  EXPECT_EQ(again.tokens, first.tokens) << "cached KV must give the same tokens";
  EXPECT_EQ(engine->stats().prefix_cache_hits_total, hits_before + 32);
  // The same tokens under another adapter, or under none, must not reuse attn-r8's KV.
  EXPECT_EQ(run_alone(*engine, prompt, "full-r16", greedy(6)).final.cached_tokens, 0);
  EXPECT_EQ(run_alone(*engine, prompt, "", greedy(6)).final.cached_tokens, 0);
  // A prompt sharing only the first two pages reuses just those.
  auto partial = prompt;
  partial[20] = (partial[20] + 1) % 256;
  EXPECT_EQ(run_alone(*engine, partial, "attn-r8", greedy(6)).final.cached_tokens, 16);
  expect_no_leaks(*engine);
}

TEST(EngineScheduling, PrefixCacheNeverServesAReloadedAdapterOfTheSameName) {
  EngineOptions o = small_options();
  o.kv_page_size = 8;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("tenant", adapter_dir("attn-r8")).ok());
  const auto prompt = test_prompt(35, 9);
  const Outcome under_attn = run_alone(*engine, prompt, "tenant", greedy(8));
  ASSERT_TRUE(engine->unload_adapter("tenant").ok());
  // Same name, different weights: nothing of the old KV may be reused.
  ASSERT_TRUE(engine->load_adapter("tenant", adapter_dir("full-r16")).ok());
  const Outcome reloaded = run_alone(*engine, prompt, "tenant", greedy(8));
  EXPECT_EQ(reloaded.final.cached_tokens, 0);
  ASSERT_TRUE(engine->load_adapter("full", adapter_dir("full-r16")).ok());
  EXPECT_EQ(reloaded.tokens, run_alone(*engine, prompt, "full", greedy(8)).tokens);
  EXPECT_NE(reloaded.tokens, under_attn.tokens);
  // Same name, same files: still a new identity (the files may have changed on disk).
  ASSERT_TRUE(engine->unload_adapter("tenant").ok());
  ASSERT_TRUE(engine->load_adapter("tenant", adapter_dir("full-r16")).ok());
  EXPECT_EQ(run_alone(*engine, prompt, "tenant", greedy(8)).final.cached_tokens, 0);
  expect_no_leaks(*engine);
}

TEST(EngineScheduling, CancelFreesPagesAndSlotRunningOrWaiting) {
  EngineOptions o = small_options();
  o.max_num_seqs = 1;  // the second request has to wait
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  Collector c(*engine);
  ASSERT_TRUE(c.submit("running", test_prompt(30, 1), "attn-r8", greedy(200)).ok());
  ASSERT_TRUE(c.submit("waiting", test_prompt(30, 2), "attn-r8", greedy(200)).ok());
  ASSERT_TRUE(c.wait_for_tokens("running", 2, 30000));
  EngineStats busy = engine->stats();
  EXPECT_EQ(busy.num_running, 1);
  EXPECT_EQ(busy.num_waiting, 1);
  EXPECT_GT(busy.kv_pages_used, 0);
  EXPECT_EQ(busy.lora_slots_used, 1);
  engine->cancel("waiting");
  engine->cancel("running");
  engine->cancel("no-such-request");  // ignored
  c.wait();
  EXPECT_EQ(c.get("running").final.reason, FinishReason::kCancelled);
  EXPECT_EQ(c.get("waiting").final.reason, FinishReason::kCancelled);
  EXPECT_LT(static_cast<int>(c.get("running").tokens.size()), 200);
  expect_no_leaks(*engine);
  // The engine goes on serving.
  EXPECT_EQ(run_alone(*engine, test_prompt(5, 3), "attn-r8", greedy(3)).tokens.size(), 3u);
}

TEST(EngineScheduling, BadRequestsAreRefusedWithoutDisturbingOthers) {
  auto engine = make_engine(small_options());
  Collector c(*engine);
  ASSERT_TRUE(c.submit("good", test_prompt(10, 1), "", greedy(20)).ok());
  EXPECT_EQ(c.submit("empty", {}, "", greedy(4)).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(c.submit("oov", {1, 2, 999}, "", greedy(4)).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(c.submit("long", test_prompt(250, 1), "", greedy(10)).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(c.submit("zero", test_prompt(5, 1), "", greedy(0)).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(c.submit("nosuch", test_prompt(5, 1), "nope", greedy(4)).code(), ErrorCode::kNotFound);
  EXPECT_EQ(c.submit("good", test_prompt(5, 1), "", greedy(4)).code(), ErrorCode::kAlreadyExists);
  c.wait();
  EXPECT_EQ(c.get("good").tokens, run_alone(*engine, test_prompt(10, 1), "", greedy(20)).tokens);
  expect_no_leaks(*engine);
}

}  // namespace
}  // namespace moelora::testing
