// The node table, control calls, shutdown and subscriptions. Setup (options, transports, dialing
// the peers) is in cluster_setup.cc, placement and freeing of leases in cluster_leases.cc, data
// channels in cluster_channels.cc, the background thread (heartbeats, failure detection, events)
// in cluster_monitor.cc and its lease checks in cluster_lease_checks.cc.
#include "farmem/client/cluster.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <utility>

#include "farmem/common/auth.h"
#include "farmem/common/version.h"
#include "farmem/transport/verbs.h"
#include "node.h"
#include "stall_meter.h"

namespace farmem::client {

using transport::TcpConnection;

namespace internal {

std::string FormatLeaseIds(std::span<const uint64_t> ids) {
  constexpr size_t kShown = 16;
  std::string out;
  for (size_t i = 0; i < ids.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += fmt::format("{:#x}", ids[i]);
  }
  if (ids.size() > kShown) out += fmt::format(" and {} more", ids.size() - kShown);
  return out;
}

void WarnOnVersionMismatch(const Endpoint& ep, const wire::HelloReply& hello) {
  const std::optional<uint32_t> theirs = wire::VersionMajor(hello.daemon_version);
  const std::optional<uint32_t> ours = wire::VersionMajor(kVersion);
  if (!theirs || !ours || *theirs == *ours) return;  // the same, or a daemon that does not say
  spdlog::warn(
      "farmem client: {} runs farmemd {} but this client is farmem {}: major versions {} and {} "
      "differ; upgrade one side so that both run the same major version",
      ep.ToString(), hello.daemon_version, kVersionString, *theirs, *ours);
}

}  // namespace internal

const char* EventTypeName(EventType type) {
  switch (type) {
    case EventType::kNodeDown:
      return "NodeDown";
    case EventType::kNodeUp:
      return "NodeUp";
    case EventType::kLeasesLost:
      return "LeasesLost";
    case EventType::kEvictNotice:
      return "EvictNotice";
    case EventType::kLeasesReturned:
      return "LeasesReturned";
  }
  return "Unknown";
}

Cluster::Node* Cluster::FindNode(NodeId id) const {
  MutexLock lock(&mu_);
  return id < nodes_.size() ? nodes_[id].get() : nullptr;
}

std::vector<NodeId> Cluster::AliveNodes() const {
  MutexLock lock(&mu_);
  std::vector<NodeId> out;
  for (const auto& n : nodes_) {
    if (n->alive) out.push_back(n->id);
  }
  return out;
}

size_t Cluster::node_count() const {
  MutexLock lock(&mu_);
  return nodes_.size();
}

size_t Cluster::alive_count() const { return AliveNodes().size(); }

bool Cluster::alive(NodeId id) const {
  MutexLock lock(&mu_);
  return id < nodes_.size() && nodes_[id]->alive;
}

NodeInfo Cluster::node(NodeId id) const {
  MutexLock lock(&mu_);
  NodeInfo info;
  info.id = id;
  if (id >= nodes_.size()) {
    info.last_error = NotFound(fmt::format("no node {}: the cluster has {}", id, nodes_.size()));
    return info;
  }
  const Node& n = *nodes_[id];
  info.endpoint = n.endpoint;
  info.alive = n.alive;
  info.suspect = n.alive && Clock::now() < n.suspect_until;
  info.daemon_id = n.daemon_id;
  info.stat = n.stat;
  info.leases_held = n.leases.size();
  info.lease_ttl_ms = n.lease_ttl_ms;
  info.accesses_reported = n.accesses->reported();
  info.noticed_not_held = n.noticed_not_held;
  info.last_error = n.last_error;
  info.last_contact = n.last_contact;
  return info;
}

LeaseState Cluster::GetLeaseState(const Lease& lease) const {
  MutexLock lock(&mu_);
  if (lease.node >= nodes_.size()) return LeaseState::kGone;
  const Node& n = *nodes_[lease.node];
  if (n.leases.contains(lease.id())) return n.alive ? LeaseState::kHeld : LeaseState::kRetained;
  if (n.retained.contains(lease.id())) return LeaseState::kRetained;
  return LeaseState::kGone;
}

Status Cluster::WaitForNode(NodeId id, NodeState state, std::chrono::milliseconds timeout) const {
  const bool want_alive = state == NodeState::kUp;
  const Clock::time_point deadline = Clock::now() + timeout;
  // The state is polled (a short interval, against a deadline) rather than signalled: node
  // liveness changes on the background thread under mu_, and no caller is on a hot path.
  std::optional<uint64_t> seen_emitted;  // events to see dispatched once the state holds
  for (;;) {
    {
      MutexLock lock(&mu_);
      if (id >= nodes_.size()) {
        return NotFound(fmt::format("no node {}: the cluster has {}", id, nodes_.size()));
      }
      const Node& n = *nodes_[id];
      if (n.alive == want_alive && !seen_emitted) seen_emitted = events_emitted_;
      if (n.alive != want_alive) seen_emitted.reset();
      if (seen_emitted && events_dispatched_ >= *seen_emitted) return Status::Ok();
      if (Clock::now() >= deadline) {
        return Status(
            StatusCode::kDeadlineExceeded,
            fmt::format("{} is {} after {} ms, waiting for {}{} (last error: {})", n.name(),
                        n.alive ? "up" : "down", timeout.count(), want_alive ? "up" : "down",
                        seen_emitted ? ": its events are not dispatched yet" : "",
                        n.last_error.ToString()));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::vector<NodeInfo> Cluster::nodes() const {
  const size_t count = node_count();
  std::vector<NodeInfo> out;
  out.reserve(count);
  for (NodeId id = 0; id < count; ++id) out.push_back(node(id));
  return out;
}

Status Cluster::CheckOpen() const {
  MutexLock lock(&mu_);
  if (closed_) return Aborted("the farmem cluster client is closed");
  return Status::Ok();
}

// ---- control calls ----

Result<std::vector<uint8_t>> Cluster::CallLocked(Node& node, wire::Opcode op,
                                                 std::span<const uint8_t> body,
                                                 std::optional<std::chrono::milliseconds> timeout) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  if (!node.conn) {
    MutexLock lock(&mu_);
    const std::string why = node.last_error.ok() ? "" : ": " + node.last_error.ToString();
    return Err(Unavailable(
        fmt::format("{} is {}{}", node.name(), node.alive ? "reconnecting" : "down", why)));
  }
  {
    MutexLock fd_lock(&node.call_fd_mu);
    node.call_fd = node.conn->pollable_fd();
    node.call_aborted = false;
  }
  auto reply = node.conn->Call(op, body, timeout.value_or(options_.op_timeout));
  bool aborted = false;
  {
    MutexLock fd_lock(&node.call_fd_mu);
    node.call_fd = -1;
    aborted = node.call_aborted;
  }
  CollectPushes(node);
  if (reply) {
    if (aborted) node.conn.reset();  // answered just as it was shut down: keep the answer
    MutexLock lock(&mu_);
    NoteContactLocked(node, Clock::now());
    return reply;
  }
  Status err = reply.error();
  if (aborted) {
    // What the socket's shutdown made of the call says nothing; the down's reason does.
    MutexLock lock(&mu_);
    err = Unavailable(fmt::format("{} on {}: declared down while the call waited ({})",
                                  wire::OpcodeName(static_cast<uint8_t>(op)),
                                  node.endpoint.ToString(), node.last_error.ToString()));
  }
  const bool transport_failure = aborted || internal::IsTransportFailure(err, *node.conn);
  if (!aborted && !node.conn->broken()) {
    // The daemon's own message names neither the operation nor the daemon.
    err = err.WithContext(fmt::format("{} on {}", wire::OpcodeName(static_cast<uint8_t>(op)),
                                      node.endpoint.ToString()));
  }
  if (transport_failure) {
    node.conn.reset();
    {
      MutexLock lock(&mu_);
      node.last_error = err;
      node.probe = true;
      probe_requested_ = true;
    }
    wake_.SignalAll();
  }
  return Err(std::move(err));
}

Result<wire::StatReply> Cluster::StatNode(Node& node) {
  MutexLock call(&node.call_mu);
  FARMEM_ASSIGN_OR_RETURN(auto body, CallLocked(node, wire::Opcode::kStat, {}, QuickCallTimeout()));
  auto stat = wire::DecodeStatReply(body);
  if (!stat) return Err(stat.error().WithContext(fmt::format("STAT reply from {}", node.name())));
  MutexLock lock(&mu_);
  node.stat = *stat;
  return *stat;
}

Result<Lease> Cluster::AllocOn(Node& node) {
  MutexLock call(&node.call_mu);
  std::vector<uint8_t> req;
  wire::EncodeAlloc(wire::AllocRequest{1}, &req);
  FARMEM_ASSIGN_OR_RETURN(auto body, CallLocked(node, wire::Opcode::kAlloc, req));
  auto reply = wire::DecodeAllocReply(body);
  if (!reply)
    return Err(reply.error().WithContext(fmt::format("ALLOC reply from {}", node.name())));
  MutexLock lock(&mu_);
  // A reply that grants more (or other) than asked is a daemon bug: give back the extras.
  for (size_t i = 1; i < reply->leases.size(); ++i) {
    node.to_free.push_back(reply->leases[i].lease_id);
  }
  if (reply->leases.empty() || reply->leases[0].length == 0) {
    if (!reply->leases.empty()) node.to_free.push_back(reply->leases[0].lease_id);
    return Err(ProtocolError(fmt::format("ALLOC reply from {} granted {} leases ({}), asked for 1",
                                         node.name(), reply->leases.size(),
                                         reply->leases.empty() ? "none" : "empty slab")));
  }
  if (reply->leases.size() > 1) {
    spdlog::warn("farmem client: {} granted {} leases for ALLOC 1; freeing the extras", node.name(),
                 reply->leases.size());
  }
  const wire::LeaseGrant& grant = reply->leases[0];
  node.leases.insert(grant.lease_id);
  node.accesses->Track(grant.lease_id);
  if (node.stat && node.stat->free_slabs > 0) --node.stat->free_slabs;
  if (node.stat && node.stat->client_free_slabs > 0) --node.stat->client_free_slabs;
  return Lease{node.id, grant};
}

Status Cluster::SendFreeLocked(Node& node, std::span<const uint64_t> ids) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  Status first;
  for (size_t pos = 0; pos < ids.size(); pos += wire::kMaxLeasesPerCall) {
    const auto chunk =
        ids.subspan(pos, std::min<size_t>(wire::kMaxLeasesPerCall, ids.size() - pos));
    std::vector<uint8_t> req;
    wire::EncodeFree(wire::FreeRequest{{chunk.begin(), chunk.end()}}, &req);
    auto r = CallLocked(node, wire::Opcode::kFree, req);
    if (r) continue;
    const StatusCode code = r.error().code();
    if (code == StatusCode::kNotFound || code == StatusCode::kExpired) {
      // Some lease was already gone (evicted, expired). If the daemon refused the whole call for
      // it, the others are still held: free them one by one; "gone" is what we wanted anyway.
      for (size_t i = 0; chunk.size() > 1 && i < chunk.size(); ++i) {
        std::vector<uint8_t> one;
        wire::EncodeFree(wire::FreeRequest{{chunk[i]}}, &one);
        auto r1 = CallLocked(node, wire::Opcode::kFree, one);
        if (r1 || r1.error().code() == StatusCode::kNotFound ||
            r1.error().code() == StatusCode::kExpired) {
          continue;
        }
        if (first.ok()) first = r1.error();
        if (!node.conn) {
          MutexLock lock(&mu_);
          node.to_free.insert(node.to_free.end(), ids.begin() + pos + i, ids.end());
          return first;
        }
      }
      continue;
    }
    if (first.ok()) first = r.error();
    if (!node.conn) {
      // The connection failed: whatever was not confirmed is freed once the daemon answers.
      MutexLock lock(&mu_);
      node.to_free.insert(node.to_free.end(), ids.begin() + pos, ids.end());
      return first;
    }
  }
  return first;
}

Result<wire::StatReply> Cluster::Stat(NodeId id) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  Node* node = FindNode(id);
  if (node == nullptr) {
    return Err(NotFound(fmt::format("no node {}: the cluster has {}", id, node_count())));
  }
  return StatNode(*node);
}

// ---- shutdown ----

Status Cluster::FreeAll() {
  Status first;
  std::vector<Node*> all;
  {
    MutexLock lock(&mu_);
    for (const auto& n : nodes_) all.push_back(n.get());
  }
  for (Node* node : all) {
    MutexLock call(&node->call_mu);
    std::vector<uint64_t> ids;
    {
      MutexLock lock(&mu_);
      ids.assign(node->leases.begin(), node->leases.end());
      if (node->alive) ids.insert(ids.end(), node->to_free.begin(), node->to_free.end());
      node->leases.clear();
      node->to_free.clear();
    }
    if (ids.empty() || !node->conn) continue;
    Status st = SendFreeLocked(*node, ids);
    if (!st.ok() && first.ok()) {
      first =
          st.WithContext(fmt::format("freeing leases {} at close (the daemon reclaims them "
                                     "after the lease TTL)",
                                     internal::FormatLeaseIds(ids)));
    }
  }
  return first;
}

Status Cluster::Close() {
  if (internal::t_monitor_of == this) {
    return InvalidArgument(
        "Cluster::Close called from an event callback (it would wait for itself)");
  }
  MutexLock close_lock(&close_mu_);
  {
    MutexLock lock(&mu_);
    if (closed_) return Status::Ok();
    closed_ = true;
    stopping_ = true;
  }
  wake_.SignalAll();
  if (monitor_.joinable()) monitor_.join();
  Status st = FreeAll();
  std::vector<Node*> all;
  {
    MutexLock lock(&mu_);
    for (const auto& n : nodes_) all.push_back(n.get());
    pending_events_.clear();
  }
  for (Node* node : all) {
    MutexLock call(&node->call_mu);
    node->conn.reset();
    MutexLock lock(&mu_);
    node->alive = false;
  }
  {
    MutexLock lock(&subs_mu_);
    subscribers_.clear();
  }
  return st;
}

// ---- events ----

SubscriptionId Cluster::Subscribe(EventCallback callback) {
  MutexLock lock(&subs_mu_);
  const SubscriptionId id = next_subscription_++;
  subscribers_.emplace(id, std::make_shared<EventCallback>(std::move(callback)));
  return id;
}

void Cluster::Unsubscribe(SubscriptionId id) {
  {
    MutexLock lock(&subs_mu_);
    subscribers_.erase(id);
  }
  // Wait out a callback that may be running (not from inside one: that would wait for itself).
  if (internal::t_monitor_of != this) MutexLock wait(&dispatch_mu_);
}

Result<TcpConnection> Cluster::ControlConnection(NodeId id) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  const NodeInfo info = node(id);
  if (id >= node_count()) return Err(info.last_error);
  if (!info.alive) {
    return Err(Unavailable(fmt::format("daemon {} is down: {}", info.endpoint.ToString(),
                                       info.last_error.ToString())));
  }
  return ConnectTo(info.endpoint, options_.connect_timeout);
}

}  // namespace farmem::client
