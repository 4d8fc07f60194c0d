// The hand-off between the engine thread and the HTTP thread that answers one request (all its
// choices). The engine's callback must be quick and must never block, whatever the client does,
// so deliver() only appends to a per-choice mailbox and signals; the HTTP thread takes whole
// mailboxes. The channel is bounded: a choice's mailbox holds at most the tokens not yet sent,
// which max_tokens bounds, and a slow client makes its mailbox batch several tokens per read
// instead of queueing events.
//
// Latency metrics are observed here, on the engine thread as tokens are produced, so a slow
// reader does not distort them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/engine.h"
#include "server/metrics.h"

namespace moelora::server {

using Clock = std::chrono::steady_clock;

// What reached one choice since the HTTP thread last looked.
struct ChoiceDelivery {
  std::vector<TokenEvent> tokens;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  Status error;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;
};

class RequestChannel {
 public:
  RequestChannel(int num_choices, Clock::time_point arrival, ServerMetrics* metrics);

  // Engine thread. Never blocks for long (one mutex, no I/O).
  void deliver(int choice, const RequestOutput& out);

  // HTTP thread: waits until something is pending or `timeout` passes, then moves every
  // choice's mailbox into `out` (resized to the number of choices). False on timeout.
  bool wait_take(std::chrono::milliseconds timeout, std::vector<ChoiceDelivery>* out);

  // The server ended a choice itself (a stop string matched): when the engine then reports the
  // cancellation, the metrics count it as `outcome`, not as an abort.
  void set_outcome_override(int choice, RequestOutcome outcome);

  int num_choices() const { return static_cast<int>(mail_.size()); }

  // Called (outside the lock, on the engine thread) after every delivery: the HTTP session
  // uses it to wake up and write, instead of a thread blocking in wait_take. Must be quick.
  void set_listener(std::function<void()> listener);

  // Seconds from arrival to the first token of any choice (negative: none yet), for the log.
  double first_token_seconds() const;

 private:
  struct Timing {
    bool got_first = false;
    Clock::time_point last_token;
    bool has_override = false;
    RequestOutcome override_outcome = RequestOutcome::kStop;
  };

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ChoiceDelivery> mail_;
  std::vector<Timing> timing_;
  bool pending_ = false;
  std::function<void()> listener_;
  double first_token_s_ = -1.0;
  Clock::time_point arrival_;
  ServerMetrics* metrics_;
};

}  // namespace moelora::server
