// A CPU backend whose adapter placements the test controls (tests of asynchronous placement,
// lora/slot_pool.h): a placement begun while the gate is closed stops at its first upload, on the
// slot pool's worker, until the test opens the gate (a large adapter's copy, made as slow as the
// test wants); a placement begun while `fail_new` is set fails there with that error (out of
// device memory, say). Everything else is the CPU backend's, so outputs are the reference's.
// Synchronisation is by condition variable only: tests wait for "n placements are held at the
// gate", never for a duration.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "tests/testutil/forwarding_backend.h"

namespace moelora::testutil {

class PlacementGate {
 public:
  // Placements begun from now on stop at their first upload until open().
  void close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  // Lets every held placement go (and later ones pass).
  void open() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      closed_ = false;
      ++generation_;
    }
    cv_.notify_all();
  }
  // Placements begun from now on fail at their first upload with `s` (ok: they succeed again).
  void fail_new(Status s) {
    std::lock_guard<std::mutex> lk(mu_);
    fail_ = std::move(s);
  }
  // Waits until `n` placements are held at the gate; false after `timeout_ms`.
  bool wait_held(int n, int timeout_ms = 30000) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return held_ == n; });
  }
  int begun() {
    std::lock_guard<std::mutex> lk(mu_);
    return begun_;
  }
  int uploads() {  // factors uploaded, by every placement
    std::lock_guard<std::mutex> lk(mu_);
    return uploads_;
  }
  void note_upload() {
    std::lock_guard<std::mutex> lk(mu_);
    ++uploads_;
  }

  // What a placement learns when it begins (engine thread).
  struct Ticket {
    bool gated = false;
    uint64_t generation = 0;
    Status fail;
  };
  Ticket begin() {
    std::lock_guard<std::mutex> lk(mu_);
    ++begun_;
    return {closed_, generation_, fail_};
  }
  // Worker: holds a gated placement until the gate opens after it began.
  void pass(const Ticket& t) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!t.gated) return;
    ++held_;
    cv_.notify_all();
    cv_.wait(lk, [&] { return generation_ != t.generation; });
    --held_;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  uint64_t generation_ = 0;
  Status fail_;
  int held_ = 0, begun_ = 0, uploads_ = 0;
};

class GatedPlacementBackend final : public ForwardingCpuBackend {
 public:
  explicit GatedPlacementBackend(std::shared_ptr<PlacementGate> gate) : gate_(std::move(gate)) {}
  std::string name() const override { return "cpu-gated"; }

  std::unique_ptr<LoraPlacement> begin_lora_placement(int slot, size_t bytes) override {
    return std::make_unique<Placement>(cpu_.begin_lora_placement(slot, bytes), gate_, gate_->begin());
  }

 private:
  class Placement final : public LoraPlacement {
   public:
    Placement(std::unique_ptr<LoraPlacement> inner, std::shared_ptr<PlacementGate> gate, PlacementGate::Ticket t)
        : inner_(std::move(inner)), gate_(std::move(gate)), ticket_(std::move(t)) {}
    Result<Tensor> upload(const Tensor& host) override {
      if (first_) {
        first_ = false;
        gate_->pass(ticket_);
        if (!ticket_.fail.ok()) return ticket_.fail;
      }
      gate_->note_upload();
      return inner_->upload(host);
    }
    void set_lora(LoraModuleTable& t, const Tensor& a, const Tensor& b, int rank) override {
      inner_->set_lora(t, a, b, rank);
    }
    void set_moe_lora(MoeLoraTable& t, const Backend::MoeLoraSlot& s) override { inner_->set_moe_lora(t, s); }
    Status finish() override { return inner_->finish(); }
    bool ready() override { return inner_->ready(); }
    void commit() override { inner_->commit(); }

   private:
    std::unique_ptr<LoraPlacement> inner_;
    std::shared_ptr<PlacementGate> gate_;
    PlacementGate::Ticket ticket_;
    bool first_ = true;
  };
  std::shared_ptr<PlacementGate> gate_;
};

}  // namespace moelora::testutil
