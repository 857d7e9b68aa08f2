// CPU time of the calling thread: what work costs a core, whatever else the machine runs (on a
// shared machine the wall clock mostly measures waiting for a core).
//
//   ThreadCpuMeter cpu(compaction_cpu_ns_);  // adds this scope's thread CPU time to the counter
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>

namespace farmem {

// User + system CPU time of the calling thread, in ns.
inline uint64_t ThreadCpuNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Adds the CPU time the calling thread spends in this object's scope to `total`.
class ThreadCpuMeter {
 public:
  explicit ThreadCpuMeter(std::atomic<uint64_t>& total) : total_(total) {}
  ~ThreadCpuMeter() { total_.fetch_add(ThreadCpuNs() - start_, std::memory_order_relaxed); }
  ThreadCpuMeter(const ThreadCpuMeter&) = delete;
  ThreadCpuMeter& operator=(const ThreadCpuMeter&) = delete;

 private:
  std::atomic<uint64_t>& total_;
  const uint64_t start_ = ThreadCpuNs();
};

}  // namespace farmem
