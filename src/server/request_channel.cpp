#include "server/request_channel.h"

namespace moelora::server {

RequestChannel::RequestChannel(int num_choices, Clock::time_point arrival, ServerMetrics* metrics)
    : mail_(num_choices), timing_(num_choices), arrival_(arrival), metrics_(metrics) {}

namespace {
RequestOutcome outcome_of(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return RequestOutcome::kStop;
    case FinishReason::kLength: return RequestOutcome::kLength;
    case FinishReason::kCancelled: return RequestOutcome::kAbort;
    default: return RequestOutcome::kError;
  }
}
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

void RequestChannel::deliver(int choice, const RequestOutput& out) {
  const Clock::time_point now = Clock::now();
  std::function<void()> listener;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ChoiceDelivery& m = mail_[choice];
    Timing& t = timing_[choice];
    if (!out.tokens.empty() && metrics_ != nullptr) {
      if (!t.got_first) metrics_->observe_time_to_first_token(seconds(now - arrival_));
      else metrics_->observe_inter_token_latency(seconds(now - t.last_token) / static_cast<double>(out.tokens.size()));
    }
    if (!out.tokens.empty() && first_token_s_ < 0) first_token_s_ = seconds(now - arrival_);
    if (!out.tokens.empty()) {
      t.got_first = true;
      t.last_token = now;
    }
    m.tokens.insert(m.tokens.end(), out.tokens.begin(), out.tokens.end());
    m.prompt_tokens = out.prompt_tokens;
    m.completion_tokens = out.completion_tokens;
    m.cached_tokens = out.cached_tokens;
    if (out.finished) {
      m.finished = true;
      m.reason = out.reason;
      m.error = out.error;
      if (metrics_ != nullptr)
        metrics_->observe_finished(t.has_override ? t.override_outcome : outcome_of(out.reason), seconds(now - arrival_),
                                   out.prompt_tokens, out.completion_tokens);
    }
    pending_ = true;
    listener = listener_;
  }
  cv_.notify_one();
  if (listener) listener();
}

void RequestChannel::set_listener(std::function<void()> listener) {
  std::lock_guard<std::mutex> lk(mu_);
  listener_ = std::move(listener);
}

double RequestChannel::first_token_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return first_token_s_;
}

bool RequestChannel::wait_take(std::chrono::milliseconds timeout, std::vector<ChoiceDelivery>* out) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return pending_; })) return false;
  out->resize(mail_.size());
  for (size_t i = 0; i < mail_.size(); ++i) {
    (*out)[i] = std::move(mail_[i]);
    mail_[i] = ChoiceDelivery();
  }
  pending_ = false;
  return true;
}

void RequestChannel::set_outcome_override(int choice, RequestOutcome outcome) {
  std::lock_guard<std::mutex> lk(mu_);
  timing_[choice].has_override = true;
  timing_[choice].override_outcome = outcome;
}

}  // namespace moelora::server
