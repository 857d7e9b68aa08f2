// FakeCgroup: a cgroup v2 memory directory whose usage a test or benchmark sets, for farmemd
// --memory-source cgroup:DIR (daemon/src/memory_source.h reads memory.max, memory.current and
// memory.events). Writes are atomic (rename), so the daemon never reads half a value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

namespace farmem::testing {

class FakeCgroup {
 public:
  // Creates `dir` with memory.max = `limit` and half of it available.
  FakeCgroup(std::filesystem::path dir, uint64_t limit) : dir_(std::move(dir)), limit_(limit) {
    std::filesystem::create_directories(dir_);
    Put("memory.max", std::to_string(limit_));
    Put("memory.events", "max 0\noom 0\n");
    SetAvailable(limit_ / 2);
  }
  // memory.current = limit - `bytes`.
  void SetAvailable(uint64_t bytes) { Put("memory.current", std::to_string(limit_ - bytes)); }
  const std::filesystem::path& dir() const { return dir_; }
  uint64_t limit() const { return limit_; }

 private:
  void Put(const std::string& name, const std::string& text) {
    const auto tmp = dir_ / (name + ".tmp");
    std::ofstream(tmp) << text << "\n";
    std::filesystem::rename(tmp, dir_ / name);
  }
  std::filesystem::path dir_;
  uint64_t limit_;
};

}  // namespace farmem::testing
