#include "farmem/common/log_every.h"

#include <fmt/format.h>

namespace farmem {

bool LogEvery::Allow(uint64_t* suppressed) {
  MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  if (last_ != std::chrono::steady_clock::time_point{} && now - last_ < period_) {
    ++suppressed_;
    return false;
  }
  last_ = now;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

std::string Suppressed(uint64_t n) {
  return n == 0 ? std::string() : fmt::format(" ({} similar lines left out)", n);
}

}  // namespace farmem
