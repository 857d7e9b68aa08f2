// MemorySource: how much memory the lending machine (or the cgroup farmemd runs in) has left.
//
// farmemd lends only what its host does not need (issue 12): the Reclaimer (reclaimer.h) polls a
// MemorySource and keeps --reserve of it free. Three real sources and a fake for tests:
//   - host: /proc/meminfo MemTotal/MemAvailable and PSI /proc/pressure/memory;
//   - cgroup v2: the daemon's cgroup memory.max/memory.current (+ inactive_file from memory.stat,
//     which the kernel reclaims before it fails an allocation), memory.events "max"/"oom" counts
//     and the cgroup's memory.pressure;
//   - cgroup v1: memory.limit_in_bytes/memory.usage_in_bytes (+ total_inactive_file), failcnt,
//     and the host's PSI (v1 has no per-cgroup PSI).
// A cgroup without a limit (v2 "max", v1's huge default) is no limit: then the host is the source.
//
// Every source reads files under a root given at construction, so tests can point it at a
// directory of their own. Read() is called from one thread (the Reclaimer's); sources keep no
// state between reads but the paths.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"

namespace farmem::daemon {

struct MemorySnapshot {
  uint64_t limit = 0;      // what the host / cgroup may use in all, bytes
  uint64_t available = 0;  // what is still available of it, bytes
  // PSI "full avg10" (percent of the last 10 s in which every task stalled on memory); nullopt
  // when the kernel does not say.
  std::optional<double> psi_full_avg10;
  // PSI "full total" (microseconds of full stall since boot) and when it was read: the policy
  // takes the stall share of the last interval from two readings, which follows the present;
  // avg10 lags by seconds and would keep a past stall looking current.
  std::optional<uint64_t> psi_full_total_us;
  std::chrono::steady_clock::time_point taken{};
  // How often the limit was hit (v2 memory.events max + oom, v1 memory.failcnt): a rising count
  // is pressure even when usage looks fine. 0 where unknown.
  uint64_t limit_hits = 0;
};

class MemorySource {
 public:
  virtual ~MemorySource() = default;
  virtual Result<MemorySnapshot> Read() = 0;
  // "host", "cgroup v2 /sys/fs/cgroup/farmem", ...: for logs and messages.
  virtual std::string name() const = 0;
};

// `spec`: "auto" (the daemon's own cgroup when it has a memory limit, else the host), "host",
// "cgroup" (the daemon's own cgroup, which must have a limit), or "cgroup:DIR" (that cgroup's
// directory, v1 or v2). `proc` and `cgroup_root` are for tests.
Result<std::unique_ptr<MemorySource>> OpenMemorySource(
    const std::string& spec, const std::filesystem::path& proc = "/proc",
    const std::filesystem::path& cgroup_root = "/sys/fs/cgroup");

std::unique_ptr<MemorySource> HostMemorySource(const std::filesystem::path& proc = "/proc");
// `dir` holds memory.max (v2) or memory.limit_in_bytes (v1); `proc` is for the host PSI of v1.
std::unique_ptr<MemorySource> CgroupMemorySource(const std::filesystem::path& dir,
                                                 const std::filesystem::path& proc = "/proc");

// A source whose readings the test sets (thread-safe).
class FakeMemorySource final : public MemorySource {
 public:
  void Set(const MemorySnapshot& s) {
    MutexLock lock(&mu_);
    snap_ = s;
    fail_ = false;
  }
  void Fail() {
    MutexLock lock(&mu_);
    fail_ = true;
  }
  Result<MemorySnapshot> Read() override {
    MutexLock lock(&mu_);
    if (fail_) return Err(IoError("fake memory source: failing as told"));
    return snap_;
  }
  std::string name() const override { return "fake"; }

 private:
  Mutex mu_;
  MemorySnapshot snap_ GUARDED_BY(mu_);
  bool fail_ GUARDED_BY(mu_) = false;
};

// Parses "some avg10=0.00 avg60=... \nfull avg10=1.25 ..." (PSI); nullopt if there is no full line.
std::optional<double> ParsePsiFullAvg10(const std::string& text);
std::optional<uint64_t> ParsePsiFullTotal(const std::string& text);

}  // namespace farmem::daemon
