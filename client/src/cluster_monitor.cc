// The Cluster's background thread: heartbeats (which keep leases alive), failure detection,
// reconnection, DNS refresh, and delivery of events to subscribers. What it checks of the leases
// (retried FREEs, probes, retained and noticed leases) is in cluster_lease_checks.cc.
//
// The monitor thread keeps the rounds; each node's heartbeat and reconnect run on that node's own
// worker thread (Node::worker). A daemon that hangs holds up only its own worker, which the next
// rounds skip until it is done: every responsive daemon is renewed once per heartbeat interval
// however many others are slow or stopped, so a slow daemon never costs the leases on healthy ones
// (docs/reliability.md). No daemon is declared down without a failed exchange of its own.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>

#include "farmem/client/cluster.h"
#include "node.h"
#include "stall_meter.h"

namespace farmem::client {

using std::chrono::milliseconds;
using transport::TcpConnection;

namespace {

// A daemon's lease TTL before its first HEARTBEAT answer said it (farmemd's --lease-ttl-ms
// default).
constexpr milliseconds kDefaultLeaseTtl{10000};

milliseconds Remaining(Clock::time_point deadline, Clock::time_point now) {
  return std::chrono::duration_cast<milliseconds>(deadline - now);
}

}  // namespace

void Cluster::MonitorLoop() {
  internal::t_monitor_of = this;
  const milliseconds interval = options_.heartbeat_interval;
  Clock::time_point next_beat = Clock::now();  // first round at once: learn the lease TTLs
  Clock::time_point next_dns = Clock::now() + options_.dns_refresh_interval;
  for (;;) {
    {
      MutexLock lock(&mu_);
      wake_.WaitUntil(&mu_, next_beat, [&] {
        mu_.AssertHeld();
        return stopping_ || probe_requested_ || !pending_events_.empty();
      });
      if (stopping_) break;
      probe_requested_ = false;
    }
    DispatchEvents();

    Clock::time_point now = Clock::now();
    const bool beat = now >= next_beat;
    if (beat) next_beat = std::max(next_beat + interval, now);

    // Queue this round's heartbeats and reconnects on the nodes' workers. One still busy with an
    // earlier one (a daemon that does not answer, a reconnect waiting out its timeout) is
    // skipped: it must not hold up the renewal of anyone else's leases. (Leases past their
    // EVICT_NOTICE deadline are ended by the worker after its heartbeat: ExpireNoticed.)
    std::vector<Node*> start;
    {
      MutexLock lock(&mu_);
      for (const auto& n : nodes_) {
        ExpireRetained(*n);
        if (n->working || n->work != Node::Work::kNone) continue;
        if (n->alive && (beat || n->probe)) {
          n->work = Node::Work::kHeartbeat;
        } else if (!n->alive && n->next_reconnect != Clock::time_point::max() &&
                   now >= n->next_reconnect) {
          n->work = Node::Work::kReconnect;
        } else {
          continue;
        }
        if (!n->worker.joinable()) start.push_back(n.get());
        n->work_cv.SignalAll();
      }
    }
    for (Node* n : start) n->worker = std::thread([this, n] { NodeWorkerLoop(*n); });

    now = Clock::now();
    if (dns_endpoint_ && now >= next_dns) {
      RefreshDns();
      next_dns = Clock::now() + options_.dns_refresh_interval;
    }
    DispatchEvents();
  }
  {
    MutexLock lock(&mu_);
    for (const auto& n : nodes_) n->work_cv.SignalAll();  // stopping_ is set: workers end
  }
  // Only this thread adds nodes (RefreshDns) and starts workers: the list is stable here.
  std::vector<Node*> all;
  {
    MutexLock lock(&mu_);
    for (const auto& n : nodes_) all.push_back(n.get());
  }
  for (Node* n : all) {
    if (n->worker.joinable()) n->worker.join();
  }
  internal::t_monitor_of = nullptr;
}

void Cluster::NodeWorkerLoop(Node& node) {
  for (;;) {
    Node::Work work;
    {
      MutexLock lock(&mu_);
      node.work_cv.Wait(&mu_, [&] {
        mu_.AssertHeld();
        return stopping_ || node.work != Node::Work::kNone;
      });
      if (stopping_) return;
      work = node.work;
      node.work = Node::Work::kNone;
      node.working = true;
    }
    if (work == Node::Work::kHeartbeat) {
      Heartbeat(node);
    } else {
      Reconnect(node);
    }
    bool noticed;
    {
      MutexLock lock(&mu_);
      noticed = !node.noticed.empty();
    }
    if (noticed) ExpireNoticed(node);
    MutexLock lock(&mu_);
    node.working = false;
    // A probe asked for while this one ran: the monitor queues it now, not at the next beat.
    if (node.probe) {
      probe_requested_ = true;
      wake_.SignalAll();
    }
  }
}

void Cluster::Heartbeat(Node& node) {
  // A user call in flight holds the connection; its answer counts as contact, and its failure
  // reports itself. Skip this node for this round rather than hold up everyone else's heartbeat,
  // unless the node has not answered for the whole failure window: then the call may be stuck
  // on a daemon that answers nothing, and waiting for its op_timeout would hold off detection.
  if (!internal::LockWithin(&node.call_mu, options_.heartbeat_interval)) {
    ProbeBusyNode(node);
    return;
  }
  MutexLock call(&node.call_mu, kAdoptLock);

  Clock::time_point deadline;
  std::chrono::nanoseconds stalled{0};  // what this process lost to its own stalls since contact
  auto stalled_since_contact = [&] {
    MutexLock lock(&mu_);
    return StalledSinceContactLocked(node);
  };
  {
    MutexLock lock(&mu_);
    if (!node.alive) return;
    node.probe = false;
    // failure_timeout after the last answer, plus the time this process itself did not run
    // since then (a deadline that expired while we were descheduled is no evidence against the
    // daemon), but never less than half of it from now: if this node's worker itself was held
    // up (a slow reconnect of this node, a user call holding call_mu), the node still gets a
    // fair chance to answer.
    stalled = StalledSinceContactLocked(node);
    deadline = std::max(FailureWindowEndLocked(node, stalled),
                        Clock::now() + options_.failure_timeout / 2);
  }
  // The last quarter of the window is kept for a re-probe on a fresh connection (a new HELLO):
  // one heartbeat that timed out makes the node suspect, not down.
  const milliseconds reprobe = std::max(options_.failure_timeout / 4, milliseconds(50));
  Status failure;
  uint32_t daemon_count = UINT32_MAX;  // leases the daemon holds for this client, if it said
  if (node.conn) {
    const milliseconds timeout = std::clamp(Remaining(deadline - reprobe, Clock::now()),
                                            milliseconds(50), options_.failure_timeout);
    // With the client's counts of what the daemon cannot see (verbs operations), for its victim
    // choice under memory pressure; committed only once the daemon has taken them.
    const wire::HeartbeatRequest report = PendingAccessReport(node);
    std::vector<uint8_t> body;
    wire::EncodeHeartbeat(report, &body);
    auto reply = node.conn->Call(wire::Opcode::kHeartbeat, body, timeout);
    CollectPushes(node);
    if (reply) {
      node.accesses->Commit(report);
      auto hb = wire::DecodeHeartbeatReply(*reply);
      MutexLock lock(&mu_);
      NoteContactLocked(node, Clock::now());
      node.last_error = Status::Ok();
      if (hb) {
        node.lease_ttl_ms = hb->lease_ttl_ms;
        node.remote_leases_held = hb->leases_held;
        // Notices pushed on an earlier connection, or before these leases were adopted here.
        NoteNoticed(node, hb->noticed, /*all=*/false);
        if (hb->leases_held < node.leases.size()) daemon_count = hb->leases_held;
        if (hb->lease_ttl_ms != 0 &&
            static_cast<uint64_t>(options_.failure_timeout.count()) >= hb->lease_ttl_ms &&
            !node.warned_lease_mismatch) {
          spdlog::warn(
              "farmem client: {} reclaims leases after {} ms without heartbeat, but "
              "failure_timeout is {} ms: leases may expire before a failure is noticed",
              node.name(), hb->lease_ttl_ms, options_.failure_timeout.count());
          node.warned_lease_mismatch = true;
        }
      } else {
        spdlog::warn("farmem client: bad HEARTBEAT reply from {}: {}", node.name(),
                     hb.error().ToString());
      }
      // (fall through to retry pending FREEs below, outside this lock)
    } else if (!internal::IsTransportFailure(reply.error(), *node.conn)) {
      // The daemon answered, with an error: it is alive. Odd, but not a failure of the node.
      MutexLock lock(&mu_);
      NoteContactLocked(node, Clock::now());
      node.last_error = reply.error();
      spdlog::warn("farmem client: HEARTBEAT to {} answered {}", node.name(),
                   reply.error().ToString());
      return;
    } else {
      failure = reply.error();
      node.conn.reset();
      MutexLock lock(&mu_);
      // Suspect while it is re-probed: placement gives it no new slab meanwhile.
      node.suspect_until = std::max(node.suspect_until, deadline);
    }
    if (failure.ok()) {
      if (daemon_count != UINT32_MAX) CheckLeasesHeldLocked(node, daemon_count);
      RetryPendingFreesLocked(node);
      return;
    }
  } else {
    MutexLock lock(&mu_);
    failure = node.last_error.ok() ? Unavailable("connection dropped") : node.last_error;
  }

  // The connection is gone: try to reopen it before the failure deadline. A refused connection
  // means the daemon is gone now; a slow one gets until the deadline, moved on by whatever this
  // process lost to its own stalls meanwhile, and at least the re-probe's share of the window.
  {
    const std::chrono::nanoseconds now_stalled = stalled_since_contact();
    if (now_stalled > stalled) {
      deadline += std::chrono::duration_cast<Clock::duration>(now_stalled - stalled);
      stalled = now_stalled;
    }
  }
  const Clock::time_point now = Clock::now();
  const milliseconds timeout =
      std::clamp(Remaining(deadline, now), std::min(reprobe, options_.connect_timeout),
                 options_.connect_timeout);
  auto conn = ConnectTo(node.endpoint, timeout);
  if (conn) {
    if (Adopt(node, std::move(*conn))) {
      auto reply = node.conn->Call(wire::Opcode::kHeartbeat, {}, QuickCallTimeout());
      CollectPushes(node);
      if (!reply && internal::IsTransportFailure(reply.error(), *node.conn)) node.conn.reset();
      if (node.conn) ReclaimRetainedLocked(node);
      if (node.conn) RetryPendingFreesLocked(node);
    }
    return;
  }
  Status reason = Status(conn.error().code(), fmt::format("{}; reconnecting: {}", failure.message(),
                                                          conn.error().message()));
  // (The connect timeout is whole milliseconds: it may end a little before the deadline.)
  if (conn.error().code() != StatusCode::kDeadlineExceeded ||
      Clock::now() + milliseconds(2) >= deadline) {
    MarkDown(node, std::move(reason));
  } else {
    MutexLock lock(&mu_);
    node.last_error = std::move(reason);
  }
}

void Cluster::Reconnect(Node& node) {
  if (!internal::LockWithin(&node.call_mu, options_.heartbeat_interval)) return;
  MutexLock call(&node.call_mu, kAdoptLock);
  {
    MutexLock lock(&mu_);
    if (node.alive) return;
  }
  auto conn = ConnectTo(node.endpoint, options_.connect_timeout);
  if (!conn) {
    MutexLock lock(&mu_);
    node.last_error = conn.error();
    // Refused: nothing listens there, so the process that held the leases is gone (a paused or
    // slow one still has its listener): they cannot come back, stop waiting for its TTL.
    if (IsConnectionRefused(conn.error()) && !node.retained.empty()) {
      node.retained_until = Clock::now();
      ExpireRetained(node, "refuses connections (its process is gone)");
    }
    // Refused is cheap to retry; a timeout costs this thread connect_timeout, so back off.
    if (conn.error().code() == StatusCode::kDeadlineExceeded) {
      // While it may still hold our leases (a pause, a false down), keep trying often enough to
      // get them back before its lease TTL runs out.
      const milliseconds cap =
          node.retained.empty() ? 8 * reconnect_interval_ : 2 * reconnect_interval_;
      node.reconnect_backoff = std::min(2 * node.reconnect_backoff, cap);
    } else {
      node.reconnect_backoff = reconnect_interval_;
    }
    node.next_reconnect = Clock::now() + node.reconnect_backoff;
    return;
  }
  if (!Adopt(node, std::move(*conn))) return;
  auto reply = node.conn->Call(wire::Opcode::kHeartbeat, {}, QuickCallTimeout());
  CollectPushes(node);
  if (!reply && internal::IsTransportFailure(reply.error(), *node.conn)) {
    node.conn.reset();
    return;
  }
  ReclaimRetainedLocked(node);  // the HEARTBEAT above renewed them, if they are still there
  RetryPendingFreesLocked(node);
  auto stat = node.conn ? node.conn->Call(wire::Opcode::kStat, {}, QuickCallTimeout())
                        : Result<std::vector<uint8_t>>(Err(Unavailable("")));
  if (stat) {
    if (auto s = wire::DecodeStatReply(*stat)) {
      MutexLock lock(&mu_);
      node.stat = *s;
    }
  }
}

bool Cluster::Adopt(Node& node, TcpConnection conn) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  const uint64_t daemon_id = conn.hello().node_id;
  const Clock::time_point now = Clock::now();
  MutexLock lock(&mu_);
  for (const auto& other : nodes_) {
    if (other.get() != &node && other->alive && other->daemon_id == daemon_id) {
      node.last_error = InvalidArgument(
          fmt::format("{} reaches the same daemon as {}", node.endpoint.ToString(), other->name()));
      node.next_reconnect = now + 8 * reconnect_interval_;
      spdlog::warn("farmem client: {}", node.last_error.message());
      return false;
    }
  }
  const bool was_alive = node.alive;
  if (node.daemon_id != 0 && node.daemon_id != daemon_id) {
    // A new incarnation knows nothing of this client: every lease there is gone (zeroed), also
    // those retained since the node was declared down.
    std::vector<uint64_t> lost(node.leases.begin(), node.leases.end());
    lost.insert(lost.end(), node.retained.begin(), node.retained.end());
    node.lost.insert(node.leases.begin(), node.leases.end());
    node.leases.clear();
    node.retained.clear();
    node.to_free.clear();
    // Nor is the data-path suspicion of the old process (Cluster::ReportFailure) about this one.
    node.suspect_until = {};
    node.suspect_window = std::chrono::milliseconds(0);
    Status reason = Expired(fmt::format("the daemon at {} restarted (node id {:#x} -> {:#x})",
                                        node.endpoint.ToString(), node.daemon_id, daemon_id));
    if (!lost.empty()) {
      spdlog::warn("farmem client: {}; leases lost: [{}]", reason.message(),
                   internal::FormatLeaseIds(lost));
      Emit(Event{EventType::kLeasesLost, node.id, node.endpoint, std::move(lost), 0, reason, {}});
    }
  }
  node.daemon_id = daemon_id;
  node.features = conn.hello().features;
  internal::WarnOnVersionMismatch(node.endpoint, conn.hello());
  node.alive = true;
  NoteContactLocked(node, now);
  node.last_error = Status::Ok();
  node.reconnect_backoff = reconnect_interval_;
  node.conn.emplace(std::move(conn));
  if (!was_alive) {
    spdlog::info("farmem client: {} is up", node.name());
    Emit(Event{EventType::kNodeUp, node.id, node.endpoint, {}, 0, Status::Ok(), {}});
  }
  return true;
}

void Cluster::NoteContactLocked(Node& node, Clock::time_point at) {
  node.last_contact = at;
  node.stall_at_contact = stall_meter_->total();
}

std::chrono::nanoseconds Cluster::StalledSinceContactLocked(const Node& node) const {
  return std::clamp(stall_meter_->total() - node.stall_at_contact, std::chrono::nanoseconds(0),
                    std::chrono::nanoseconds(options_.failure_timeout));
}

Clock::time_point Cluster::FailureWindowEndLocked(const Node& node,
                                                  std::chrono::nanoseconds stalled) const {
  return node.last_contact + options_.failure_timeout +
         std::chrono::duration_cast<Clock::duration>(stalled);
}

void Cluster::ProbeBusyNode(Node& node) {
  {
    MutexLock lock(&mu_);
    if (!node.alive) return;
    // Heartbeat's window: failure_timeout after the last answer, plus what this process lost
    // to its own stalls since then.
    if (Clock::now() < FailureWindowEndLocked(node, StalledSinceContactLocked(node))) {
      return;  // not overdue: the call's answer may still come
    }
  }
  // A HELLO on a new connection: the daemon's admission thread answers it even while the call's
  // connection thread is busy (a long ALLOC), and a paused or hung daemon does not.
  const milliseconds timeout =
      std::clamp(options_.failure_timeout / 2, milliseconds(50), options_.connect_timeout);
  auto probe = ConnectTo(node.endpoint, timeout);
  if (probe) {
    MutexLock lock(&mu_);
    NoteContactLocked(node, Clock::now());
    return;
  }
  DeclareDown(node, Status(probe.error().code(),
                           fmt::format("no answer for {} ms while a call held its connection; "
                                       "probed on a new connection: {}",
                                       options_.failure_timeout.count(), probe.error().message())));
  // The call would otherwise wait out its own op_timeout (ALLOC, FREE: tens of seconds), and
  // its caller with it (placement, a span set's allocation, a page write).
  AbortCallInFlight(node);
}

void Cluster::AbortCallInFlight(Node& node) {
  MutexLock lock(&node.call_fd_mu);
  if (node.call_fd < 0 || node.call_aborted) return;
  node.call_aborted = true;
  ::shutdown(node.call_fd, SHUT_RDWR);
}

void Cluster::MarkDown(Node& node, Status reason) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  node.conn.reset();
  DeclareDown(node, std::move(reason));
}

void Cluster::DeclareDown(Node& node, Status reason) {
  MutexLock lock(&mu_);
  if (!node.alive) return;
  node.alive = false;
  node.last_error = reason;
  node.reconnect_backoff = reconnect_interval_;
  node.next_reconnect = Clock::now() + reconnect_interval_;
  std::vector<uint64_t> lost(node.leases.begin(), node.leases.end());
  node.lost.insert(node.leases.begin(), node.leases.end());
  // Not freed: the same daemon process may answer again with them intact (it was only slow, or
  // paused); ReclaimRetainedLocked hands them back then. Its lease TTL after its last answer,
  // it has ended them (ExpireRetained). A borrower that replaces one meanwhile frees it (Free
  // moves it to to_free).
  node.retained.insert(node.leases.begin(), node.leases.end());
  const milliseconds ttl =
      node.lease_ttl_ms != 0 ? milliseconds(node.lease_ttl_ms) : kDefaultLeaseTtl;
  node.retained_until = std::max(node.retained_until, node.last_contact + ttl);
  node.leases.clear();
  spdlog::warn(
      "farmem client: {} is down ({}); leases unreachable, kept in case it answers again "
      "within its lease TTL ({} ms): [{}]",
      node.name(), reason.ToString(), ttl.count(), internal::FormatLeaseIds(lost));
  Emit(Event{
      EventType::kNodeDown, node.id, node.endpoint, std::move(lost), 0, std::move(reason), {}});
}

void Cluster::RefreshDns() {
  auto addrs = ResolveAll(dns_endpoint_->host);
  if (!addrs) {
    spdlog::debug("farmem client: re-resolving {}: {}", options_.peers_dns,
                  addrs.error().ToString());
    return;
  }
  for (const std::string& a : *addrs) {
    Endpoint ep{a, dns_endpoint_->port};
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      const bool known = std::any_of(nodes_.begin(), nodes_.end(),
                                     [&](const auto& n) { return n->endpoint == ep; }) ||
                         std::find(aliases_.begin(), aliases_.end(), ep) != aliases_.end();
      if (known) continue;
    }
    auto conn = ConnectTo(ep, options_.connect_timeout);
    if (!conn) {
      spdlog::debug("farmem client: {} (from {}) does not answer: {}", ep.ToString(),
                    options_.peers_dns, conn.error().ToString());
      continue;
    }
    Node* node = nullptr;
    {
      MutexLock lock(&mu_);
      const uint64_t daemon_id = conn->hello().node_id;
      const bool alias = std::any_of(nodes_.begin(), nodes_.end(), [&](const auto& n) {
        return n->alive && n->daemon_id == daemon_id;
      });
      if (alias) {
        aliases_.push_back(ep);
        continue;
      }
      // Joins down, so nobody uses it before Adopt (only this thread adopts).
      node = AddNode(ep);
      node->next_reconnect = Clock::time_point::max();
    }
    MutexLock call(&node->call_mu);
    spdlog::info("farmem client: new daemon {} from {}", ep.ToString(), options_.peers_dns);
    (void)Adopt(*node, std::move(*conn));
  }
}

void Cluster::Emit(Event event) {
  if (stopping_) return;
  pending_events_.push_back(std::move(event));
  ++events_emitted_;
  wake_.SignalAll();
}

void Cluster::DispatchEvents() {
  std::vector<Event> events;
  {
    MutexLock lock(&mu_);
    events.swap(pending_events_);
  }
  if (events.empty()) return;
  MutexLock dispatch(&dispatch_mu_);
  for (const Event& ev : events) {
    std::vector<std::shared_ptr<EventCallback>> subs;
    {
      MutexLock lock(&subs_mu_);
      for (const auto& [id, cb] : subscribers_) subs.push_back(cb);
    }
    for (const auto& cb : subs) (*cb)(ev);
  }
  MutexLock lock(&mu_);
  events_dispatched_ += events.size();
}

}  // namespace farmem::client
