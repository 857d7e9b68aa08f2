#include "farmem/transport/fault_injection.h"

#include <fmt/format.h>

#include <deque>
#include <utility>

namespace farmem::transport {

void FaultInjector::Fail(const Endpoint& peer, Status status, uint64_t count, uint64_t after) {
  MutexLock lock(&mu_);
  Rule& r = rules_[Key(peer)];
  r.fail = true;
  r.status = std::move(status);
  r.fail_left = count;
  r.pass_first = after;
}

void FaultInjector::Hold(const Endpoint& peer) {
  MutexLock lock(&mu_);
  rules_[Key(peer)].hold = true;
}

void FaultInjector::Release(const Endpoint& peer) {
  MutexLock lock(&mu_);
  rules_[Key(peer)].hold = false;
  released_.SignalAll();
}

void FaultInjector::Clear(const Endpoint& peer) {
  MutexLock lock(&mu_);
  Rule& r = rules_[Key(peer)];
  r.hold = false;
  r.fail = false;
  released_.SignalAll();
}

uint64_t FaultInjector::ops_posted(const Endpoint& peer) const {
  MutexLock lock(&mu_);
  auto it = rules_.find(Key(peer));
  return it == rules_.end() ? 0 : it->second.posted;
}

uint64_t FaultInjector::ops_failed(const Endpoint& peer) const {
  MutexLock lock(&mu_);
  auto it = rules_.find(Key(peer));
  return it == rules_.end() ? 0 : it->second.failed;
}

uint64_t FaultInjector::ops_held(const Endpoint& peer) const {
  MutexLock lock(&mu_);
  auto it = rules_.find(Key(peer));
  return it == rules_.end() ? 0 : it->second.held;
}

FaultInjector::Decision FaultInjector::OnPost(const Endpoint& peer) {
  MutexLock lock(&mu_);
  Rule& r = rules_[Key(peer)];
  ++r.posted;
  if (r.fail) {
    if (r.pass_first > 0) {
      --r.pass_first;
    } else {
      ++r.failed;
      Decision d{Action::kFail, r.status};
      if (r.fail_left > 0 && --r.fail_left == 0) r.fail = false;
      return d;
    }
  }
  if (r.hold) {
    ++r.held;
    return {Action::kHold, Status::Ok()};
  }
  return {};
}

bool FaultInjector::holding(const Endpoint& peer) const {
  MutexLock lock(&mu_);
  auto it = rules_.find(Key(peer));
  return it != rules_.end() && it->second.hold;
}

bool FaultInjector::WaitReleased(const Endpoint& peer,
                                 std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&mu_);
  const std::string key = Key(peer);
  return released_.WaitUntil(&mu_, deadline, [&] {
    mu_.AssertHeld();
    auto it = rules_.find(key);
    return it == rules_.end() || !it->second.hold;
  });
}

namespace {

using Clock = std::chrono::steady_clock;

// Ops the injector failed complete from `ready_`; held ones wait in `held_` (in order, and every
// op posted after a held one queues behind it) and go to the real channel when released. One held
// for op_timeout completes with DeadlineExceeded, as a real channel's op to a daemon that does
// not answer does, and is dropped (a stalled daemon never sees it: late delivery is not modelled).
class FaultyChannel final : public Channel {
 public:
  FaultyChannel(std::unique_ptr<Channel> inner, Endpoint peer,
                std::shared_ptr<FaultInjector> injector, std::chrono::milliseconds op_timeout)
      : inner_(std::move(inner)),
        peer_(std::move(peer)),
        injector_(std::move(injector)),
        op_timeout_(op_timeout) {}

  Status Post(const Op& op) override {
    if (outstanding() >= max_outstanding()) {
      return ResourceExhausted(
          fmt::format("{} operations already outstanding on {}", outstanding(), inner_->peer()));
    }
    const FaultInjector::Decision d = injector_->OnPost(peer_);
    switch (d.action) {
      case FaultInjector::Action::kFail:
        ready_.push_back({op.user_data, d.status});
        return Status::Ok();
      case FaultInjector::Action::kHold:
        held_.push_back({op, Clock::now() + op_timeout_});
        return Status::Ok();
      case FaultInjector::Action::kPass:
        break;
    }
    if (!held_.empty()) {  // keep the order: behind what is held
      held_.push_back({op, Clock::now() + op_timeout_});
      return Status::Ok();
    }
    return inner_->Post(op);
  }

  Status Flush() override {
    SendReleased();
    return inner_->Flush();
  }

  Result<size_t> Poll(std::span<Completion> out, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    ExpireHeld();
    if (!held_.empty() && ready_.empty() && inner_->outstanding() == 0) {
      injector_->WaitReleased(peer_, std::min(deadline, held_.front().deadline));
      ExpireHeld();
    }
    SendReleased();
    size_t n = 0;
    while (n < out.size() && !ready_.empty()) {
      out[n++] = std::move(ready_.front());
      ready_.pop_front();
    }
    if (n < out.size() && inner_->outstanding() > 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto got = inner_->Poll(out.subspan(n), n > 0 ? std::chrono::milliseconds(0)
                                                    : std::max(left, std::chrono::milliseconds(0)));
      if (!got.has_value()) {
        if (n == 0) return got;
      } else {
        n += *got;
      }
    }
    return n;
  }

  size_t outstanding() const override {
    return inner_->outstanding() + held_.size() + ready_.size();
  }
  size_t max_outstanding() const override { return inner_->max_outstanding(); }
  const char* kind() const override { return "fault-injected"; }
  std::string peer() const override { return inner_->peer(); }
  bool broken() const override { return inner_->broken(); }
  ChannelStats stats() const override { return inner_->stats(); }
  // The real channel's: readable when its replies arrive. Failed and released ops are reaped by
  // the zero-timeout Poll that callers (client::ChannelSet) give every channel whose fd readiness
  // is not exact before they wait.
  int wait_fd() const override { return inner_->wait_fd(); }

 private:
  struct Held {
    Op op;
    Clock::time_point deadline;
  };

  void ExpireHeld() {
    const auto now = Clock::now();
    while (!held_.empty() && held_.front().deadline <= now) {
      ready_.push_back(
          {held_.front().op.user_data,
           DeadlineExceeded(fmt::format("{}: no answer within {} ms (held by the fault injector)",
                                        inner_->peer(), op_timeout_.count()))});
      held_.pop_front();
    }
  }

  // Moves released held ops to the real channel (a post it refuses completes with its error).
  void SendReleased() {
    if (held_.empty() || injector_->holding(peer_)) return;
    bool posted = false;
    while (!held_.empty()) {
      if (inner_->outstanding() >= inner_->max_outstanding()) break;  // the rest on a later call
      const Op op = held_.front().op;
      held_.pop_front();
      if (Status s = inner_->Post(op); !s.ok()) {
        ready_.push_back({op.user_data, std::move(s)});
      } else {
        posted = true;
      }
    }
    // A failed flush: the real channel completes what it could not send on its next Poll.
    if (posted) (void)inner_->Flush();
  }

  std::unique_ptr<Channel> inner_;
  Endpoint peer_;
  std::shared_ptr<FaultInjector> injector_;
  std::chrono::milliseconds op_timeout_;
  std::deque<Held> held_;
  std::deque<Completion> ready_;
};

}  // namespace

std::unique_ptr<Channel> WithFaults(std::unique_ptr<Channel> channel, const Endpoint& peer,
                                    std::shared_ptr<FaultInjector> injector,
                                    std::chrono::milliseconds op_timeout) {
  if (!injector) return channel;
  return std::make_unique<FaultyChannel>(std::move(channel), peer, std::move(injector), op_timeout);
}

}  // namespace farmem::transport
