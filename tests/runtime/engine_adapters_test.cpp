// Adapters as scheduled resources: backend slots (--max-loras-per-batch) shared by more
// adapters than slots, host memory (--max-loaded-loras) with LRU eviction, transparent reload
// and pinning, unloading while requests use an adapter.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "engine_test_util.h"

namespace moelora::testing {
namespace {

const std::vector<std::string> kAdapters = {"attn-r8", "full-r16", "mlp-rslora-r4", "pattern"};

bool on_host(Engine& e, const std::string& name) {
  for (const AdapterInfo& a : e.adapters())
    if (a.name == name) return a.on_host;
  return false;
}

TEST(EngineAdapters, MoreAdaptersThanSlotsAllFinishWithTheirOwnOutput) {
  EngineOptions o;
  o.max_loras_per_batch = 2;
  o.max_loaded_loras = 8;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  for (const std::string& a : kAdapters) ASSERT_TRUE(engine->load_adapter(a, adapter_dir(a)).ok()) << a;
  std::vector<Outcome> alone;
  for (size_t i = 0; i < 8; ++i) alone.push_back(run_alone(*engine, test_prompt(10, i), kAdapters[i % 4], greedy(24)));
  Collector c(*engine);
  for (size_t i = 0; i < 8; ++i) ASSERT_TRUE(c.submit(fmt::format("r{}", i), test_prompt(10, i), kAdapters[i % 4], greedy(24)).ok());
  ASSERT_TRUE(c.submit("base", test_prompt(10, 99), "", greedy(24)).ok());
  // While they run, never more distinct adapters in the running set than slots.
  int max_running_adapters = 0, max_slots = 0;
  for (int i = 0; i < 2000; ++i) {
    const EngineStats s = engine->stats();
    max_running_adapters = std::max(max_running_adapters, static_cast<int>(s.running_adapters.size()));
    max_slots = std::max(max_slots, s.lora_slots_used);
    if (s.num_running == 0 && s.num_waiting == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  c.wait();
  EXPECT_LE(max_running_adapters, 2);
  EXPECT_LE(max_slots, 2);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(c.get(fmt::format("r{}", i)).tokens, alone[i].tokens) << kAdapters[i % 4];
  expect_no_leaks(*engine);
}

TEST(EngineAdapters, ARequestWaitingForASlotIsNotStarvedByResidentAdapters) {
  // One slot, a steady flow of requests for the resident adapter, and one request for another
  // adapter: it must get the slot once the requests that arrived before it are done, instead of
  // waiting for as long as the flow lasts.
  EngineOptions o;
  o.max_loras_per_batch = 1;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("resident", adapter_dir("attn-r8")).ok());
  ASSERT_TRUE(engine->load_adapter("other", adapter_dir("full-r16")).ok());
  Collector c(*engine);
  int submitted = 0;
  auto submit_resident = [&] {
    // Staggered lengths: the resident requests never all finish in the same step.
    ASSERT_TRUE(c.submit(fmt::format("res{}", submitted), test_prompt(8, submitted), "resident",
                         greedy(12 + 9 * (submitted % 3)))
                    .ok());
    ++submitted;
  };
  for (int i = 0; i < 3; ++i) submit_resident();
  ASSERT_TRUE(c.wait_for_tokens("res0", 1, 30000));
  ASSERT_TRUE(c.submit("other", test_prompt(8, 99), "other", greedy(4)).ok());
  int finished_after_other = 0;  // resident requests submitted after "other" that finished before it
  std::vector<bool> counted(64, false);
  for (int round = 0; round < 4000 && !c.get("other").final.finished; ++round) {
    int in_flight = 0;
    for (int i = 0; i < submitted; ++i) {
      const bool done = c.get(fmt::format("res{}", i)).final.finished;
      in_flight += !done;
      if (done && i >= 3 && !counted[i]) {
        counted[i] = true;
        ++finished_after_other;
      }
    }
    if (in_flight < 3 && submitted < 60) submit_resident();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(c.get("other").final.finished) << "starved: " << submitted << " resident requests went first";
  EXPECT_EQ(finished_after_other, 0) << "requests that arrived later took the slot first";
  c.wait();
  expect_no_leaks(*engine);
}

TEST(EngineAdapters, HostLruEvictsAndReloadsTransparently) {
  EngineOptions o;
  o.max_loras_per_batch = 1;
  o.max_loaded_loras = 2;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  const Outcome before = run_alone(*engine, test_prompt(12, 1), "attn-r8", greedy(10));
  ASSERT_TRUE(engine->load_adapter("full-r16", adapter_dir("full-r16")).ok());
  ASSERT_TRUE(engine->load_adapter("mlp-rslora-r4", adapter_dir("mlp-rslora-r4")).ok());
  // Three adapters, room for two: the least recently used (attn-r8) left host memory...
  EXPECT_FALSE(on_host(*engine, "attn-r8"));
  EXPECT_TRUE(on_host(*engine, "full-r16"));
  EXPECT_TRUE(on_host(*engine, "mlp-rslora-r4"));
  EXPECT_EQ(engine->adapters().size(), 3u) << "evicted adapters stay registered";
  // ...and comes back on its next request with the same output.
  EXPECT_EQ(run_alone(*engine, test_prompt(12, 1), "attn-r8", greedy(10)).tokens, before.tokens);
  EXPECT_TRUE(on_host(*engine, "attn-r8"));
  EXPECT_FALSE(on_host(*engine, "full-r16")) << "now full-r16 is the least recently used";
  expect_no_leaks(*engine);
}

TEST(EngineAdapters, PinnedAdaptersStayInHostMemory) {
  EngineOptions o;
  o.max_loras_per_batch = 1;
  o.max_loaded_loras = 2;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8"), /*pinned=*/true).ok());
  for (const char* a : {"full-r16", "mlp-rslora-r4", "pattern"})
    ASSERT_TRUE(engine->load_adapter(a, adapter_dir(a)).ok()) << a;
  EXPECT_TRUE(on_host(*engine, "attn-r8"));
  for (const AdapterInfo& a : engine->adapters()) EXPECT_TRUE(a.name != "attn-r8" || a.pinned);
  int resident = 0;
  for (const AdapterInfo& a : engine->adapters()) resident += a.on_host;
  EXPECT_EQ(resident, 2);
  // Using the others in turn never drops the pinned one.
  for (const char* a : {"full-r16", "mlp-rslora-r4", "pattern"}) {
    EXPECT_EQ(run_alone(*engine, test_prompt(6, 2), a, greedy(3)).tokens.size(), 3u);
    EXPECT_TRUE(on_host(*engine, "attn-r8"));
  }
}

TEST(EngineAdapters, FailedLoadsChangeNothing) {
  EngineOptions o;
  o.max_model_len = 256;
  o.max_lora_rank = 8;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  const Outcome before = run_alone(*engine, test_prompt(8, 4), "attn-r8", greedy(6));
  EXPECT_EQ(engine->load_adapter("missing", "/nonexistent/adapter").code(), ErrorCode::kNotFound);
  EXPECT_FALSE(engine->load_adapter("too-big", adapter_dir("full-r16")).ok()) << "rank 16 > --max-lora-rank 8";
  EXPECT_EQ(engine->load_adapter("attn-r8", adapter_dir("pattern")).code(), ErrorCode::kAlreadyExists);
  EXPECT_FALSE(engine->load_adapter("bad name!", adapter_dir("attn-r8")).ok());
  EXPECT_EQ(engine->adapters().size(), 1u);
  EXPECT_EQ(run_alone(*engine, test_prompt(8, 4), "attn-r8", greedy(6)).tokens, before.tokens);
}

TEST(EngineAdapters, UnloadWaitsForRequestsUsingTheAdapter) {
  EngineOptions o;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  const Outcome alone = run_alone(*engine, test_prompt(10, 5), "attn-r8", greedy(60));
  Collector c(*engine);
  ASSERT_TRUE(c.submit("user", test_prompt(10, 5), "attn-r8", greedy(60)).ok());
  ASSERT_TRUE(c.wait_for_tokens("user", 1, 30000));
  // Without waiting, the unload is refused while the request runs.
  EXPECT_EQ(engine->unload_adapter("attn-r8").code(), ErrorCode::kFailedPrecondition);
  std::atomic<bool> unloaded{false};
  std::thread t([&] {
    EXPECT_TRUE(engine->unload_adapter("attn-r8", /*wait=*/true).ok());
    unloaded = true;
  });
  // While it drains, new requests for it are refused; the running one finishes untouched.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (!unloaded) {
    Collector late(*engine);
    EXPECT_EQ(late.submit("late", test_prompt(4, 1), "attn-r8", greedy(2)).code(), ErrorCode::kNotFound);
  }
  c.wait();
  t.join();
  EXPECT_TRUE(unloaded);
  EXPECT_EQ(c.get("user").tokens, alone.tokens);
  EXPECT_FALSE(engine->has_adapter("attn-r8"));
  expect_no_leaks(*engine);
  // The name is free again.
  ASSERT_TRUE(engine->load_adapter("attn-r8", adapter_dir("attn-r8")).ok());
  EXPECT_EQ(run_alone(*engine, test_prompt(10, 5), "attn-r8", greedy(60)).tokens, alone.tokens);
}

TEST(EngineAdapters, ConcurrentUnloadsOfOneAdapterBothSucceedOnce) {
  EngineOptions o;
  o.max_model_len = 256;
  auto engine = make_engine(o);
  ASSERT_TRUE(engine->load_adapter("twice", adapter_dir("pattern")).ok());
  Collector c(*engine);
  ASSERT_TRUE(c.submit("user", test_prompt(10, 5), "twice", greedy(40)).ok());
  ASSERT_TRUE(c.wait_for_tokens("user", 1, 30000));
  Status a, b;
  std::thread t1([&] { a = engine->unload_adapter("twice", /*wait=*/true); });
  std::thread t2([&] { b = engine->unload_adapter("twice", /*wait=*/true); });
  c.wait();
  t1.join();
  t2.join();
  EXPECT_TRUE(a.ok()) << a.to_string();
  EXPECT_TRUE(b.ok()) << b.to_string();
  EXPECT_FALSE(engine->has_adapter("twice"));
  EXPECT_EQ(engine->unload_adapter("twice").code(), ErrorCode::kNotFound);
  ASSERT_TRUE(engine->load_adapter("twice", adapter_dir("pattern")).ok());
  EXPECT_EQ(run_alone(*engine, test_prompt(4, 1), "twice", greedy(2)).tokens.size(), 2u);
  expect_no_leaks(*engine);
}

}  // namespace
}  // namespace moelora::testing
