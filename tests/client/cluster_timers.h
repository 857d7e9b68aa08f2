// Cluster timers for the client tests against real daemons: short, so that failures show up
// quickly, and generous enough for a loaded 2-vCPU CI machine. Sanitizer builds of farmemd
// answer several times slower: the timers stretch there, or a merely slow daemon gets declared
// down.
#pragma once

#include <chrono>

#include "support/sanitizer.h"

namespace farmem::client::test {

#if FARMEM_SANITIZED
inline constexpr int kTimeScale = 3;
#else
inline constexpr int kTimeScale = 1;
#endif
inline constexpr std::chrono::milliseconds kHeartbeat{100 * kTimeScale};
inline constexpr std::chrono::milliseconds kFailureTimeout{800 * kTimeScale};

}  // namespace farmem::client::test
