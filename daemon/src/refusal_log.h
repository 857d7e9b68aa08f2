// RefusalLog: the log lines of connections farmemd refuses or drops, at a rate a flood cannot
// raise.
//
// A flood of connections (idle sockets, slowloris, wrong secrets) must not become a flood of log
// lines: each kind of refusal is logged in full the first time in an interval, and after that only
// counted; at the end of the interval one line per kind says how many more there were and where
// the last came from.
//
// Threading: owned by the admission thread (server_admission.cc).
#pragma once

#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <string>

namespace farmem::daemon {

class RefusalLog {
 public:
  enum Kind {
    kHandshakeTimeout,  // no complete handshake within --handshake-timeout-ms
    kPendingLimit,      // dropped: --max-pending-handshakes reached
    kConnectionLimit,   // authenticated, but --max-connections are served already
    kWrongSecret,       // AUTH with a wrong proof
    kBadHandshake,      // anything else that broke the handshake
    kAcceptFailed,      // accept() failed (out of file descriptors)
    kKinds
  };
  using Clock = std::chrono::steady_clock;

  explicit RefusalLog(std::chrono::milliseconds interval = std::chrono::seconds(10))
      : interval_(interval) {}

  // One refusal of `kind`, from `peer`; `what` says why, for a person.
  void Note(Kind kind, const std::string& peer, const std::string& what,
            Clock::time_point now = Clock::now()) {
    Entry& e = entries_[kind];
    if (!e.logged_in_interval) {
      e.logged_in_interval = true;
      e.interval_start = now;
      spdlog::warn("{}: {} (further such refusals are counted, one line every {} s)", peer, what,
                   std::chrono::duration_cast<std::chrono::seconds>(interval_).count());
      return;
    }
    ++e.suppressed;
    e.last_peer = peer;
    e.last_what = what;
  }

  // Writes the summaries whose interval is over; returns when the next one is due (max(): none).
  Clock::time_point Flush(Clock::time_point now = Clock::now()) {
    Clock::time_point next = Clock::time_point::max();
    for (Entry& e : entries_) {
      if (!e.logged_in_interval) continue;
      const Clock::time_point due = e.interval_start + interval_;
      if (now < due) {
        next = std::min(next, due);
        continue;
      }
      if (e.suppressed > 0) {
        spdlog::warn(
            "{} more in the last {} s like this: {} (the last from {})", e.suppressed,
            std::chrono::duration_cast<std::chrono::seconds>(now - e.interval_start).count(),
            e.last_what, e.last_peer);
        // Still flooding: the next interval starts now and logs only its summary.
        e.suppressed = 0;
        e.interval_start = now;
        next = std::min(next, now + interval_);
      } else {
        e.logged_in_interval = false;
      }
    }
    return next;
  }

 private:
  struct Entry {
    bool logged_in_interval = false;
    Clock::time_point interval_start{};
    uint64_t suppressed = 0;
    std::string last_peer, last_what;
  };
  std::chrono::milliseconds interval_;
  std::array<Entry, kKinds> entries_{};
};

}  // namespace farmem::daemon
