// AdaptiveSpin: a bounded busy-wait before a thread sleeps on a socket, that backs off where it
// does not pay. The one spin policy: the wait for a daemon's reply (client::ChannelSet, the
// --busy-poll-us option) and the NBD connection's wait for its client's next request
// (--request-busy-poll-us) both run it.
//
// Why: a thread that slept must be woken, and on a VM whose idle vCPUs halt the wake-up is an IPI
// through the host (tens of µs on these machines), paid by the sender. A reply or a request that
// comes within a few tens of µs is cheaper to catch spinning. The policy:
//   - Spin() calls the probe (a non-blocking look: poll(2) with timeout 0, recv with
//     MSG_DONTWAIT) and sched_yield()s between calls, so that whatever else is runnable on this
//     CPU (the daemon being waited for, woken here) runs first;
//   - it ends when the probe has something (a hit), at the budget's end, at the caller's limit,
//     or when a yield kept this thread off the CPU for more than kBusyCpu: the CPUs are busy,
//     and a spinning thread then only queues behind others and delays them;
//   - a spin that ends without a hit makes the next 1, 2, 4 ... kMaxSkip calls return at once
//     (the caller sleeps), until a spin catches something again: where the wait is longer than
//     the budget, spinning costs at most budget / kMaxSkip per wait.
// Not thread-safe: one per waiting thread.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace farmem {

class AdaptiveSpin {
 public:
  using Clock = std::chrono::steady_clock;
  // The largest budget a caller may set (the options' range).
  static constexpr std::chrono::microseconds kMaxBudget{1000};
  // Calls that return at once after a spin without a hit: 1, 2, 4 ... up to this.
  static constexpr uint32_t kMaxSkip = 64;
  // A yield that kept this thread off the CPU longer than this ran someone else: the CPU is busy.
  static constexpr std::chrono::microseconds kBusyCpu{20};

  // Spins that ran, of those the ones that caught something, and calls that returned at once
  // because earlier spins ran out (the backoff).
  struct Stats {
    uint64_t spins = 0;
    uint64_t hits = 0;
    uint64_t skipped = 0;
  };

  // 0: Spin() returns at once (off). At most kMaxBudget. Starts afresh: no backoff left.
  void set_budget(std::chrono::microseconds budget) {
    budget_ = std::clamp(budget, std::chrono::microseconds{0}, kMaxBudget);
    skip_ = 0;
    backoff_ = 1;
  }
  std::chrono::microseconds budget() const { return budget_; }
  const Stats& stats() const { return stats_; }

  // Runs the probe until it returns non-zero, within the policy above; returns the probe's last
  // value: > 0 something is there (a hit), < 0 the probe gave up (an error the caller handles;
  // no backoff), 0 nothing came (the caller sleeps; the backoff grows). Without a budget, or
  // while backing off, returns 0 without calling the probe.
  template <typename Probe>
  int Spin(Probe&& probe, Clock::time_point limit = Clock::time_point::max()) {
    if (budget_.count() == 0) return 0;
    if (skip_ > 0) {
      --skip_;
      ++stats_.skipped;
      return 0;
    }
    ++stats_.spins;
    Clock::time_point last = Clock::now();
    const Clock::time_point until = std::min(limit, last + budget_);
    for (;;) {
      const int rc = probe();
      if (rc > 0) {
        ++stats_.hits;
        backoff_ = 1;
        return rc;
      }
      if (rc < 0) return rc;
      const Clock::time_point now = Clock::now();
      if (now >= until || now - last > kBusyCpu) {
        skip_ = backoff_;
        backoff_ = std::min(2 * backoff_, kMaxSkip);
        return 0;
      }
      ::sched_yield();
      last = Clock::now();
    }
  }

 private:
  std::chrono::microseconds budget_{0};
  uint32_t skip_ = 0;     // calls that return at once before the next spin
  uint32_t backoff_ = 1;  // skip_ after the next spin that runs out
  Stats stats_;
};

}  // namespace farmem
