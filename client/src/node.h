// Internal: the Cluster's record of one daemon, shared by cluster.cc (calls from user threads)
// and cluster_monitor.cc (the background thread).
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "farmem/client/cluster.h"
#include "farmem/common/mutex.h"
#include "farmem/transport/tcp_connection.h"
#include "lease_access_counts.h"

namespace farmem::client {

// Invariants:
//  - call_mu serializes every exchange on `conn` and is held across network I/O; it is taken
//    before Cluster::mu_, never after.
//  - Only the background threads (the monitor and this node's worker, cluster_monitor.cc) change
//    alive / daemon_id and move leases to `lost`, and they do so holding call_mu and Cluster::mu_.
//    So a thread that holds call_mu and finds `conn` set is talking to the daemon incarnation the
//    bookkeeping describes: a lease it gets there can be recorded without re-checking.
//  - conn set implies alive. User threads may drop `conn` after a transport failure (the node
//    stays alive until the background thread decides).
struct Cluster::Node {
  Node(NodeId node_id, Endpoint ep) : id(node_id), endpoint(std::move(ep)) {}

  const NodeId id;
  const Endpoint endpoint;
  // Operations on this client's leases there that the daemon does not see (verbs), counted by
  // the data channels OpenChannel wraps and reported on HEARTBEAT (kFeatureAccessReports).
  const std::shared_ptr<internal::LeaseAccessCounts> accesses =
      std::make_shared<internal::LeaseAccessCounts>();

  Mutex call_mu;
  std::optional<transport::TcpConnection> conn GUARDED_BY(call_mu);
  // The socket of `conn` while CallLocked waits on it, -1 otherwise. ProbeBusyNode, which cannot
  // take call_mu, shuts it down when it declares the node down, so the stuck call fails then,
  // not at its op_timeout (AbortCallInFlight). CallLocked clears it before `conn` can be closed,
  // so the number is never another file's. A leaf lock: nothing is taken under it.
  Mutex call_fd_mu;
  int call_fd GUARDED_BY(call_fd_mu) = -1;
  bool call_aborted GUARDED_BY(call_fd_mu) = false;  // AbortCallInFlight shut call_fd down

  // ---- guarded by Cluster::mu_ ----
  bool alive = false;
  uint64_t daemon_id = 0;
  uint32_t features = 0;  // HELLO features: kFeatureVerbs when the daemon serves RDMA
  std::optional<wire::StatReply> stat;
  std::set<uint64_t> leases;  // granted to this client there and not freed
  // Reported lost (kNodeDown / kLeasesLost) and not yet passed to Free(): Free accepts them.
  std::set<uint64_t> lost;
  // Reported in kNodeDown but maybe still held by the same daemon process (a false down, a
  // pause): a subset of `lost`, neither freed nor given up until the daemon answers again
  // (ReclaimRetainedLocked) or `retained_until` passes (its lease TTL after the last answer).
  // Free() of one moves it to to_free.
  std::set<uint64_t> retained;
  Clock::time_point retained_until{};
  // Under an EVICT_NOTICE: lease id -> when the daemon ends it (if still held then).
  std::map<uint64_t, Clock::time_point> noticed;
  // Under notice by the daemon's last HEARTBEAT reply, but not held by this Cluster (NodeInfo).
  std::vector<uint64_t> noticed_not_held;
  // The daemon may still hold these although nobody wants them (a FREE that could not be sent,
  // leases dropped while the node was unreachable): FREE them once it answers.
  std::vector<uint64_t> to_free;
  uint64_t lease_ttl_ms = 0;
  uint32_t remote_leases_held = 0;
  bool warned_lease_mismatch = false;
  Status last_error;
  Clock::time_point last_contact{};
  // StallMeter::total() at last_contact: what the client lost to its own stalls since then is
  // added to the failure deadline.
  std::chrono::nanoseconds stall_at_contact{0};
  Clock::time_point next_reconnect{};
  std::chrono::milliseconds reconnect_backoff{0};
  bool probe = false;  // ReportFailure or a failed call asked for a heartbeat now
  // A data-path error (ReportFailure) makes the node suspect until `suspect_until`, even if its
  // control connection still answers (a gray failure of the data path): placement then gives it
  // no new slab while another node can take it. The window doubles while errors keep coming
  // (see Cluster::ReportFailure).
  Clock::time_point suspect_until{};
  std::chrono::milliseconds suspect_window{0};

  // ---- this node's heartbeat worker (cluster_monitor.cc) ----
  // The monitor queues the node's heartbeat or reconnect here each round and its own worker
  // thread runs it, so a daemon that does not answer holds up only its own worker: every other
  // daemon's leases are renewed on time (docs/reliability.md). A node whose worker is still busy
  // is skipped for the round. `work` and `working` are guarded by Cluster::mu_; work_cv waits on
  // it; `worker` is started (on first use) and joined by the monitor thread only.
  enum class Work { kNone, kHeartbeat, kReconnect };
  Work work = Work::kNone;  // queued, not yet taken by the worker
  bool working = false;     // the worker runs one now
  CondVar work_cv;
  std::thread worker;

  std::string name() const {
    return "node " + std::to_string(id) + " (" + endpoint.ToString() + ")";
  }
};

namespace internal {

// Takes `mu` if it is free now or becomes free within `timeout` (polls: the background thread
// uses it where a busy node should be skipped, not waited for). Not std::timed_mutex: GCC 12's
// ThreadSanitizer does not see its pthread_mutex_clocklock and then reports false races.
inline bool LockWithin(Mutex* mu, std::chrono::milliseconds timeout) TRY_ACQUIRE(true, mu) {
  const auto deadline = Clock::now() + timeout;
  while (!mu->TryLock()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return true;
}

// Set on the background thread to its Cluster, so Close()/Unsubscribe() can tell they are being
// called from an event callback.
inline thread_local const void* t_monitor_of = nullptr;

// A failure of the connection rather than an error answered by the daemon: the connection can
// no longer be trusted (a reply may still be in flight) and must be reopened.
inline bool IsTransportFailure(const Status& s, const transport::TcpConnection& conn) {
  return conn.broken() || s.code() == StatusCode::kUnavailable ||
         s.code() == StatusCode::kDeadlineExceeded || s.code() == StatusCode::kProtocolError ||
         s.code() == StatusCode::kAborted;
}

// "0x11, 0x100000012" (hex, as daemons log them; at most 16, then "and N more").
std::string FormatLeaseIds(std::span<const uint64_t> ids);

// Logs a warning when the daemon's version (HELLO, docs/wire-protocol.md) has another major
// version than this client's; silent for a daemon that does not send its version.
void WarnOnVersionMismatch(const Endpoint& ep, const wire::HelloReply& hello);

}  // namespace internal
}  // namespace farmem::client
