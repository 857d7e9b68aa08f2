// Waiting on state, not on time: the one place where a test polls a condition with a deadline.
//
//   ASSERT_TRUE(WaitUntil([&] { return store->stats().rebuilds > 0; }, seconds(10)));
//   ASSERT_TRUE(WaitForProcessState(pid, 'T', seconds(5)));  // SIGSTOP has taken effect
//
// Tests must not sleep to let something happen; they wait here for the thing itself. A sleep is
// only for a test whose subject is time (a lease must expire, a deadline must pass), with a
// comment saying so.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

namespace farmem::testing {

// Polls `done` until it holds (true) or `timeout` passes (false; `done` is checked one last time
// at the deadline, so a slow machine is not failed by the last poll's timing).
template <typename Pred>
bool WaitUntil(Pred done, std::chrono::milliseconds timeout,
               std::chrono::milliseconds poll = std::chrono::milliseconds(5)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return done();
    // The polling interval of a wait on state (the condition is re-checked, not assumed).
    std::this_thread::sleep_for(poll);
  }
  return true;
}

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' once stopped, 'Z'...), or '?' if the
// process is gone.
inline char ProcessState(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return '?';
  // "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return '?';
  return line[close + 2];
}

// Waits until the process is in `state` (e.g. 'T': a SIGSTOP has been delivered).
inline bool WaitForProcessState(pid_t pid, char state, std::chrono::milliseconds timeout) {
  return WaitUntil([&] { return ProcessState(pid) == state; }, timeout);
}

}  // namespace farmem::testing
