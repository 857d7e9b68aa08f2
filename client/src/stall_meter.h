// StallMeter: how long this process itself did not run — descheduled on a loaded machine, stopped
// by a debugger or a cgroup freezer, its VM paused — measured as the lateness of a short periodic
// timer on a thread of its own. Failure detection subtracts it: a heartbeat deadline that passed
// while the client was not running is no evidence against the daemon (design.md: local stalls
// are never blamed on a daemon).
//
// Ownership: one per Cluster (its thread starts in the constructor, stops in the destructor).
// Threads: total() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"

namespace farmem::client::internal {

class StallMeter {
 public:
  // The timer's period, and how late a tick may be without counting (ordinary wake-up jitter).
  static constexpr std::chrono::milliseconds kPeriod{10};
  // Generous: on a loaded machine ticks run a few ms late all the time; only a real
  // descheduling (tens of ms and more) counts.
  static constexpr std::chrono::milliseconds kTolerance{50};

  StallMeter();
  ~StallMeter();
  StallMeter(const StallMeter&) = delete;
  StallMeter& operator=(const StallMeter&) = delete;

  // Time this process did not run since the meter started (monotonic, never decreases): the sum
  // over ticks of how much later than due each ran, less kTolerance.
  std::chrono::nanoseconds total() const {
    return std::chrono::nanoseconds(stalled_ns_.load(std::memory_order_relaxed));
  }

 private:
  void Run();

  std::atomic<int64_t> stalled_ns_{0};
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace farmem::client::internal
