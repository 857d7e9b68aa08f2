// Deterministic faults on the data path, for tests of failure interleavings.
//
// A FaultInjector holds rules per daemon endpoint; a data channel wrapped with WithFaults()
// consults it on every Post():
//   - Fail(peer, status, count, after): let `after` ops through, then complete the next `count`
//     ops (0: every later op, until Clear) with `status`, without sending them;
//   - Hold(peer) / Release(peer): ops posted meanwhile are kept back in order (a daemon that
//     stalls: a gray failure, a partition) and sent when released; one held for the channel's
//     op_timeout completes with DeadlineExceeded, as on a real channel, and is dropped (a late
//     delivery after the client gave up is not modelled);
//   - Clear(peer): back to passing everything.
// The real channel below still does the I/O, to a real daemon, so everything else (leases,
// heartbeats, failure detection through the control connections) stays real: only *which* data
// op fails or waits, and when, is decided by the test instead of by timing (SIGSTOP, kill).
//
//   auto faults = std::make_shared<transport::FaultInjector>();
//   cluster_options.fault_injector = faults;        // client::Cluster wraps every data channel
//   faults->Fail(daemon1, RemoteAccessError("injected"), /*count=*/1, /*after=*/2);
//
// A wrapped channel's kind() is "fault-injected": callers reap it with a zero-timeout Poll before
// they wait on its wait_fd() (the real channel's), as they do verbs channels. Threading:
// FaultInjector is thread-safe; a wrapped channel belongs to one thread, like any Channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "farmem/common/config.h"
#include "farmem/common/mutex.h"
#include "farmem/common/status.h"
#include "farmem/transport/transport.h"

namespace farmem::transport {

class FaultInjector {
 public:
  void Fail(const Endpoint& peer, Status status, uint64_t count = 0, uint64_t after = 0);
  void Hold(const Endpoint& peer);
  void Release(const Endpoint& peer);
  void Clear(const Endpoint& peer);

  // Data ops posted to `peer` on wrapped channels so far, and how many of them were failed or held.
  uint64_t ops_posted(const Endpoint& peer) const;
  uint64_t ops_failed(const Endpoint& peer) const;
  uint64_t ops_held(const Endpoint& peer) const;

  // For the wrapped channels.
  enum class Action { kPass, kFail, kHold };
  struct Decision {
    Action action = Action::kPass;
    Status status;
  };
  Decision OnPost(const Endpoint& peer);
  bool holding(const Endpoint& peer) const;
  // Waits until `peer` is not held, or the deadline. Returns !holding(peer).
  bool WaitReleased(const Endpoint& peer, std::chrono::steady_clock::time_point deadline);

 private:
  struct Rule {
    bool hold = false;
    bool fail = false;
    Status status;
    uint64_t fail_left = 0;  // 0 with fail: every op
    uint64_t pass_first = 0;
    uint64_t posted = 0, failed = 0, held = 0;
  };
  static std::string Key(const Endpoint& peer) { return peer.ToString(); }

  mutable Mutex mu_;
  CondVar released_;
  std::map<std::string, Rule> rules_ GUARDED_BY(mu_);
};

// `channel` (to `peer`, ops timing out after `op_timeout`) with the faults `injector` decides.
// A null injector returns `channel`.
std::unique_ptr<Channel> WithFaults(std::unique_ptr<Channel> channel, const Endpoint& peer,
                                    std::shared_ptr<FaultInjector> injector,
                                    std::chrono::milliseconds op_timeout);

}  // namespace farmem::transport
