// The slot pool's asynchronous placement (lora/slot_pool.h) on its own: a placement runs on the
// pool's worker and becomes visible only when poll() commits it; a failed one frees its slot and
// reports the error; evicting a loading adapter cancels it; shutdown joins a worker that is busy.
// The backend's uploads are held at a gate the test opens (testutil/gated_placement_backend.h).
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "lora/adapter.h"
#include "lora/slot_pool.h"
#include "model/model_config.h"
#include "tests/testutil/gated_placement_backend.h"
#include "tests/testutil/test_files.h"

namespace moelora {
namespace {

using testutil::fixture_path;
using testutil::GatedPlacementBackend;
using testutil::PlacementGate;

class SlotPoolTest : public ::testing::Test {
 protected:
  void make_pool(int slots) {
    auto c = load_model_config(fixture_path("qwen3moe/model-bf16"));
    ASSERT_TRUE(c.ok()) << c.status().message();
    cfg_ = *c;
    pool_ = std::make_unique<LoraSlotPool>(cfg_, backend_, slots);
    pool_->set_on_placement_done([this] {
      std::lock_guard<std::mutex> lk(mu_);
      ++done_;
      cv_.notify_all();
    });
  }
  void TearDown() override {
    gate_->open();  // a held placement must not keep the worker from joining
    pool_.reset();
  }
  std::shared_ptr<const LoraAdapter> adapter(const std::string& name) {
    auto a = load_lora_adapter(fixture_path("qwen3moe/adapters/" + name), name, cfg_);
    EXPECT_TRUE(a.ok()) << a.status().message();
    return a.ok() ? *a : nullptr;
  }
  // Waits until the worker finished `n` placements in all (the pool's own callback).
  bool wait_done(int n) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::seconds(30), [&] { return done_ >= n; });
  }
  // Sum of the host rank mirrors of `slot` over every table: what planning sees.
  int host_ranks(int slot) const {
    int sum = 0;
    for (const LayerLoraTables& l : pool_->tables()) {
      for (const LoraModuleTable* t : l.dense)
        if (t) sum += t->host_rank[slot];
      if (l.experts) sum += l.experts->host_gu_rank[slot] + l.experts->host_d_rank[slot];
    }
    return sum;
  }

  std::shared_ptr<PlacementGate> gate_ = std::make_shared<PlacementGate>();
  GatedPlacementBackend backend_{gate_};
  ModelConfig cfg_;
  std::mutex mu_;
  std::condition_variable cv_;
  int done_ = 0;
  std::unique_ptr<LoraSlotPool> pool_;  // last: destroyed before the backend
};

TEST_F(SlotPoolTest, APlacementRunsOnTheWorkerAndIsCommittedByPoll) {
  make_pool(2);
  auto a = adapter("full-r16");
  gate_->close();
  ASSERT_TRUE(pool_->start_placement(a).ok());
  ASSERT_TRUE(gate_->wait_held(1)) << "the placement never reached its first upload";
  // Held on the worker: this thread goes on, the slot is reserved and shows nothing to planning.
  EXPECT_EQ(pool_->state(a.get()), LoraSlotPool::State::kLoading);
  EXPECT_EQ(pool_->loading_slots(), 1);
  EXPECT_EQ(pool_->slot_of(a.get()), -1);
  EXPECT_TRUE(pool_->poll().empty());
  EXPECT_EQ(host_ranks(0), 0);
  gate_->open();
  ASSERT_TRUE(wait_done(1));
  auto reports = pool_->poll();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_TRUE(reports[0].status.ok()) << reports[0].status.message();
  EXPECT_EQ(reports[0].adapter, a);
  EXPECT_EQ(reports[0].slot, 0);
  EXPECT_GT(reports[0].bytes, 0u);
  EXPECT_EQ(pool_->state(a.get()), LoraSlotPool::State::kResident);
  EXPECT_EQ(pool_->slot_of(a.get()), 0);
  EXPECT_GT(host_ranks(0), 0);
  // Resident: acquire takes a reference without placing it again.
  const int begun = gate_->begun();
  auto slot = pool_->acquire(a);
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(*slot, 0);
  EXPECT_EQ(gate_->begun(), begun);
  EXPECT_EQ(pool_->used_slots(), 1);
  pool_->release(*slot);
}

TEST_F(SlotPoolTest, AFailedPlacementReportsItsErrorAndFreesTheSlot) {
  make_pool(1);
  auto a = adapter("attn-r8");
  gate_->fail_new(Status(ErrorCode::kResourceExhausted, "out of device memory (test)"));
  ASSERT_TRUE(pool_->start_placement(a).ok());
  ASSERT_TRUE(wait_done(1));
  auto reports = pool_->poll();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].status.code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(pool_->state(a.get()), LoraSlotPool::State::kAbsent);
  EXPECT_EQ(pool_->loading_slots(), 0);
  EXPECT_EQ(host_ranks(0), 0);
  // The blocking form returns the placement's error; once placements succeed again it places.
  auto failed = pool_->acquire(a);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("out of device memory (test)"), std::string::npos);
  gate_->fail_new(Status());
  auto slot = pool_->acquire(a);
  ASSERT_TRUE(slot.ok()) << slot.status().message();
  EXPECT_EQ(pool_->slot_of(a.get()), 0);
  pool_->release(*slot);
}

TEST_F(SlotPoolTest, EvictingALoadingAdapterCancelsItAndThePollThatSeesItFreesTheSlot) {
  make_pool(1);
  auto a = adapter("full-r16");
  auto b = adapter("attn-r8");
  gate_->close();
  ASSERT_TRUE(pool_->start_placement(a).ok());
  ASSERT_TRUE(gate_->wait_held(1));
  pool_->evict(a.get());  // returns at once: the worker is still inside the placement
  EXPECT_EQ(pool_->state(a.get()), LoraSlotPool::State::kLoading);
  EXPECT_FALSE(pool_->can_start_placement(/*may_evict=*/true)) << "the slot is still the worker's";
  gate_->open();
  ASSERT_TRUE(wait_done(1));
  auto reports = pool_->poll();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].status.code(), ErrorCode::kCancelled);
  EXPECT_EQ(pool_->state(a.get()), LoraSlotPool::State::kAbsent);
  EXPECT_EQ(host_ranks(0), 0) << "a cancelled placement is never committed";
  // It stopped at the next factor instead of copying the whole adapter (one A/B pair got through).
  EXPECT_LE(gate_->uploads(), 2);
  auto slot = pool_->acquire(b);
  ASSERT_TRUE(slot.ok()) << slot.status().message();
  EXPECT_EQ(*slot, 0);
  pool_->release(*slot);
}

TEST_F(SlotPoolTest, ShutdownCancelsQueuedPlacementsAndJoinsTheWorker) {
  make_pool(2);
  auto a = adapter("full-r16");
  auto b = adapter("attn-r8");
  gate_->close();
  ASSERT_TRUE(pool_->start_placement(a).ok());
  ASSERT_TRUE(pool_->start_placement(b).ok());  // queued behind the held one
  ASSERT_TRUE(gate_->wait_held(1));
  std::thread stopper([&] { pool_->shutdown(); });
  gate_->open();
  stopper.join();
  EXPECT_EQ(gate_->begun(), 2);
  // Joined: the pool is destroyed (TearDown) with both placements still unfinished, on this thread.
}

}  // namespace
}  // namespace moelora
