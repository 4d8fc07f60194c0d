// Adapter placement off the engine thread: while an adapter is copied into its slot (held at a
// gate the test opens: testutil/gated_placement_backend.h), base requests and requests for resident
// adapters keep producing tokens; the requests for the loading adapter start once it is placed and
// produce what they produce alone; a failed placement fails only its requests and frees the slot;
// unloading an adapter while it loads is safe. No sleeps: the tests wait on the gate and on the
// requests' outputs.
#include <gtest/gtest.h>

#include <thread>

#include "engine_test_util.h"
#include "model/model.h"
#include "tests/testutil/gated_placement_backend.h"

namespace moelora::testing {
namespace {

using testutil::GatedPlacementBackend;
using testutil::PlacementGate;

// An engine over the tiny model whose adapter placements wait at `gate` while it is closed.
struct GatedEngine {
  std::shared_ptr<PlacementGate> gate = std::make_shared<PlacementGate>();
  std::unique_ptr<Engine> engine;

  explicit GatedEngine(const EngineOptions& o) {
    auto backend = std::make_unique<GatedPlacementBackend>(gate);
    auto model = Model::load(tiny_model_dir(), *backend);
    EXPECT_TRUE(model.ok()) << model.status().to_string();
    auto e = Engine::create(std::move(backend), std::move(model).value(), o);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    engine = std::move(e).value();
  }
  ~GatedEngine() {
    gate->open();  // a placement held at the gate would keep the engine from stopping
    engine.reset();
  }
  Engine* operator->() { return engine.get(); }
};

void load(Engine& e, const std::string& name, const std::string& fixture) {
  ASSERT_TRUE(e.load_adapter(name, adapter_dir(fixture)).ok()) << name;
}

TEST(EngineAdapterLoading, ResidentAndBaseRequestsKeepRunningWhileAnAdapterLoads) {
  const EngineOptions o = small_options(4);
  auto ref = make_engine(o);
  GatedEngine g(o);
  for (Engine* e : {ref.get(), g.engine.get()}) {
    load(*e, "resident", "attn-r8");
    load(*e, "slow", "full-r16");
  }
  const auto p_base = test_prompt(10, 1), p_res = test_prompt(12, 2), p_slow = test_prompt(9, 3);
  const Outcome want_base = run_alone(*ref, p_base, "", greedy(12));
  const Outcome want_res = run_alone(*ref, p_res, "resident", greedy(12));
  const Outcome want_slow = run_alone(*ref, p_slow, "slow", greedy(12));
  run_alone(*g.engine, p_res, "resident", greedy(1));  // placed now, before the gate closes

  g.gate->close();
  Collector c(*g.engine);
  ASSERT_TRUE(c.submit("slow", p_slow, "slow", greedy(12)).ok());
  ASSERT_TRUE(g.gate->wait_held(1)) << "the placement never started";
  ASSERT_TRUE(c.submit("base", p_base, "", greedy(12)).ok());
  ASSERT_TRUE(c.submit("res", p_res, "resident", greedy(12)).ok());
  // Both run to the end while the copy is held: nothing waits for it but its own request.
  ASSERT_TRUE(c.wait_for_tokens("base", 12, 60000));
  ASSERT_TRUE(c.wait_for_tokens("res", 12, 60000));
  EXPECT_TRUE(c.get("base").final.finished);
  EXPECT_TRUE(c.get("res").final.finished);
  EXPECT_TRUE(c.get("slow").tokens.empty()) << "a request ran before its adapter was placed";
  EXPECT_FALSE(c.get("slow").final.finished);
  EngineStats s = g->stats();
  EXPECT_EQ(s.lora_slots_loading, 1);
  EXPECT_EQ(s.num_waiting, 1);
  EXPECT_EQ(s.waiting_adapters, std::vector<std::string>{"slow"});

  g.gate->open();
  c.wait();
  EXPECT_EQ(c.get("base").tokens, want_base.tokens);
  EXPECT_EQ(c.get("res").tokens, want_res.tokens);
  // Started after the placement completed, and its output is its output alone.
  EXPECT_EQ(c.get("slow").final.reason, FinishReason::kLength);
  EXPECT_EQ(c.get("slow").tokens, want_slow.tokens);
  s = g->stats();
  EXPECT_EQ(s.lora_loads_total, 2u);
  EXPECT_EQ(s.lora_load_failures_total, 0u);
  EXPECT_EQ(s.lora_slots_loading, 0);
  EXPECT_GT(s.lora_load_bytes_total, 0u);
  expect_no_leaks(*g.engine);
}

TEST(EngineAdapterLoading, AFailedPlacementFailsOnlyItsRequestsAndFreesTheSlot) {
  const EngineOptions o = small_options(2);
  auto ref = make_engine(o);
  GatedEngine g(o);
  for (Engine* e : {ref.get(), g.engine.get()}) {
    load(*e, "good", "attn-r8");
    load(*e, "bad", "full-r16");
  }
  const auto p_base = test_prompt(10, 4), p_good = test_prompt(11, 5), p_bad = test_prompt(9, 6);
  const Outcome want_base = run_alone(*ref, p_base, "", greedy(12));
  const Outcome want_good = run_alone(*ref, p_good, "good", greedy(12));
  const Outcome want_bad = run_alone(*ref, p_bad, "bad", greedy(12));
  run_alone(*g.engine, p_good, "good", greedy(1));

  g.gate->close();
  g.gate->fail_new(Status(ErrorCode::kResourceExhausted, "out of device memory (test)"));
  Collector c(*g.engine);
  ASSERT_TRUE(c.submit("bad1", p_bad, "bad", greedy(12)).ok());
  ASSERT_TRUE(g.gate->wait_held(1));
  ASSERT_TRUE(c.submit("bad2", p_bad, "bad", greedy(12)).ok());  // waits for the same placement
  ASSERT_TRUE(c.submit("base", p_base, "", greedy(12)).ok());
  ASSERT_TRUE(c.submit("good", p_good, "good", greedy(12)).ok());
  g.gate->fail_new(Status());  // placements begun from now on succeed
  g.gate->open();
  c.wait();
  for (const char* id : {"bad1", "bad2"}) {
    const Outcome b = c.get(id);
    EXPECT_EQ(b.final.reason, FinishReason::kError) << id;
    EXPECT_EQ(b.final.error.code(), ErrorCode::kResourceExhausted) << id;
    EXPECT_NE(b.final.error.message().find("adapter 'bad'"), std::string::npos) << b.final.error.message();
    EXPECT_NE(b.final.error.message().find("out of device memory (test)"), std::string::npos)
        << b.final.error.message();
    EXPECT_TRUE(b.tokens.empty()) << id;
  }
  EXPECT_EQ(c.get("base").tokens, want_base.tokens);
  EXPECT_EQ(c.get("good").tokens, want_good.tokens);
  EngineStats s = g->stats();
  EXPECT_EQ(s.lora_load_failures_total, 1u);
  EXPECT_EQ(s.lora_slots_loading, 0);
  // The slot was freed and the adapter is still served: its next request places it again.
  EXPECT_EQ(run_alone(*g.engine, p_bad, "bad", greedy(12)).tokens, want_bad.tokens);
  expect_no_leaks(*g.engine);
}

TEST(EngineAdapterLoading, UnloadingAnAdapterWhileItLoadsFreesItsSlotOnceTheCopyStops) {
  const EngineOptions o = small_options(1);  // one slot: the next adapter needs the cancelled one's
  auto ref = make_engine(o);
  GatedEngine g(o);
  load(*ref, "next", "attn-r8");
  load(*g.engine, "x", "full-r16");
  const auto p = test_prompt(10, 7);
  const Outcome want = run_alone(*ref, p, "next", greedy(8));

  g.gate->close();
  Collector c(*g.engine);
  ASSERT_TRUE(c.submit("r", p, "x", greedy(8)).ok());
  ASSERT_TRUE(g.gate->wait_held(1));
  g->cancel("r");
  c.wait();
  EXPECT_EQ(c.get("r").final.reason, FinishReason::kCancelled);
  // Nothing uses it now: the unload succeeds at once, without waiting for the copy.
  ASSERT_TRUE(g->unload_adapter("x").ok());
  EXPECT_FALSE(g->has_adapter("x"));
  EXPECT_EQ(g->stats().lora_slots_loading, 1) << "the worker still holds the cancelled placement";
  // A request for another adapter needs the only slot, which comes back when the worker lets go.
  load(*g.engine, "next", "attn-r8");
  Collector after(*g.engine);
  ASSERT_TRUE(after.submit("next", p, "next", greedy(8)).ok());
  g.gate->open();
  after.wait();
  EXPECT_EQ(after.get("next").tokens, want.tokens);
  const EngineStats s = g->stats();
  EXPECT_EQ(s.lora_loads_total, 1u) << "the cancelled placement is not counted as a load";
  EXPECT_EQ(s.lora_load_failures_total, 0u);
  expect_no_leaks(*g.engine);
}

TEST(EngineAdapterLoading, UnloadWithWaitLetsTheLoadingAdapterServeItsRequestsFirst) {
  const EngineOptions o = small_options(2);
  auto ref = make_engine(o);
  GatedEngine g(o);
  for (Engine* e : {ref.get(), g.engine.get()}) load(*e, "x", "full-r16");
  const auto p = test_prompt(10, 8);
  const Outcome want = run_alone(*ref, p, "x", greedy(8));

  g.gate->close();
  Collector c(*g.engine);
  ASSERT_TRUE(c.submit("r", p, "x", greedy(8)).ok());
  ASSERT_TRUE(g.gate->wait_held(1));
  Status unloaded;
  std::thread t([&] { unloaded = g->unload_adapter("x", /*wait=*/true); });
  // Whether the unload starts draining before or after the gate opens, the request is served.
  g.gate->open();
  c.wait();
  t.join();
  EXPECT_TRUE(unloaded.ok()) << unloaded.to_string();
  EXPECT_EQ(c.get("r").tokens, want.tokens);
  EXPECT_FALSE(g->has_adapter("x"));
  expect_no_leaks(*g.engine);
}

}  // namespace
}  // namespace moelora::testing
