// FakeCgroup: a cgroup v2 memory directory whose usage a test or benchmark sets, for farmemd
// --memory-source cgroup:DIR (daemon/src/memory_source.h reads memory.max, memory.current and
// memory.events). Writes are atomic (rename), so the daemon never reads half a value.
//
// The lender set-up the eviction tests and farptr_move_bench share:
//   testing::FakeCgroup cgroup(1024 * kMiB);
//   testing::DaemonSet lender({.extra_args = cgroup.LenderArgs(
//       {.reserve = 100 * kMiB, .grace = 2000ms, .interval = 50ms, .sample_extra = 2},
//       {"--no-mlock"})});
//   cgroup.SetAvailable(96 * kMiB);  // short of the reserve: the daemon sends notices
//
// Needs farmem::test_support (TempDir).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/process.h"

namespace farmem::testing {

// How a lender watching a FakeCgroup evicts (farmemd's eviction options).
struct LenderPressure {
  uint64_t reserve = 0;                    // --reserve, in bytes (whole MiB)
  std::chrono::milliseconds grace{10000};  // --evict-grace-ms
  std::chrono::milliseconds interval{50};  // --pressure-interval-ms
  int sample_extra = 2;                    // --evict-sample-extra
};

class FakeCgroup {
 public:
  // Creates the directory, in a temp dir of its own (removed with this object), with
  // memory.max = `limit` and half of it available.
  explicit FakeCgroup(uint64_t limit)
      : tmp_("fake-cgroup"), dir_(std::filesystem::path(tmp_.path()) / "cgroup"), limit_(limit) {
    std::filesystem::create_directories(dir_);
    Put("memory.max", std::to_string(limit_));
    Put("memory.events", "max 0\noom 0\n");
    SetAvailable(limit_ / 2);
  }
  // memory.current = limit - `bytes`.
  void SetAvailable(uint64_t bytes) { Put("memory.current", std::to_string(limit_ - bytes)); }
  const std::filesystem::path& dir() const { return dir_; }
  uint64_t limit() const { return limit_; }

  // farmemd arguments that make it take this directory as its host's memory and evict by `p`,
  // followed by `more`.
  std::vector<std::string> LenderArgs(const LenderPressure& p,
                                      std::vector<std::string> more = {}) const {
    std::vector<std::string> args = {"--memory-source",
                                     "cgroup:" + dir_.string(),
                                     "--reserve",
                                     std::to_string(p.reserve >> 20) + "M",
                                     "--evict-grace-ms",
                                     std::to_string(p.grace.count()),
                                     "--pressure-interval-ms",
                                     std::to_string(p.interval.count()),
                                     "--evict-sample-extra",
                                     std::to_string(p.sample_extra)};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }

 private:
  void Put(const std::string& name, const std::string& text) {
    const auto tmp = dir_ / (name + ".tmp");
    std::ofstream(tmp) << text << "\n";
    std::filesystem::rename(tmp, dir_ / name);
  }
  TempDir tmp_;
  std::filesystem::path dir_;
  uint64_t limit_;
};

}  // namespace farmem::testing
