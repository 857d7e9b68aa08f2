// LogEvery: at most one log line per period for one kind of message, saying how many were left
// out. Conditions that persist (a store that stays degraded, a cluster short of room) are
// re-checked every few seconds, and requests that fail (a client reading a lost range sector by
// sector) can fail thousands of times a second: neither may flood the log.
//
// Threading: any thread (its own mutex).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "farmem/common/mutex.h"

namespace farmem {

class LogEvery {
 public:
  explicit LogEvery(std::chrono::seconds period) : period_(period) {}
  // Whether to log now; *suppressed is set to the number of lines left out since the last one.
  bool Allow(uint64_t* suppressed) EXCLUDES(mu_);

 private:
  Mutex mu_;
  const std::chrono::seconds period_;
  std::chrono::steady_clock::time_point last_ GUARDED_BY(mu_){};
  uint64_t suppressed_ GUARDED_BY(mu_) = 0;
};

// " (N similar lines left out)", or nothing for 0.
std::string Suppressed(uint64_t n);

}  // namespace farmem
