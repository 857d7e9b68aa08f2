#include "stall_meter.h"

namespace farmem::client::internal {

StallMeter::StallMeter() : thread_([this] { Run(); }) {}

StallMeter::~StallMeter() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void StallMeter::Run() {
  MutexLock lock(&mu_);
  Clock::time_point due = Clock::now() + kPeriod;
  while (!stop_) {
    cv_.WaitUntil(&mu_, due, [&] {
      mu_.AssertHeld();
      return stop_;
    });
    const Clock::time_point now = Clock::now();
    const auto late = now - due - kTolerance;
    if (late > Clock::duration::zero()) {
      stalled_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(late).count(),
                            std::memory_order_relaxed);
    }
    due = now + kPeriod;
  }
}

}  // namespace farmem::client::internal
