// The Cluster's view of its leases against what each daemon says: FREEs retried once a daemon
// answers, leases probed one by one (a one-byte READ) after a reconnect or when a daemon holds
// fewer than expected, retained leases handed back or expired, and eviction notices (pushed, or
// past their deadline). Called from the monitor's rounds (cluster_monitor.cc).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "farmem/client/cluster.h"
#include "node.h"

namespace farmem::client {

using transport::TcpConnection;

void Cluster::RetryPendingFreesLocked(Node& node) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    ids.swap(node.to_free);
  }
  if (ids.empty() || !node.conn) {
    MutexLock lock(&mu_);
    node.to_free.insert(node.to_free.end(), ids.begin(), ids.end());
    return;
  }
  Status st = SendFreeLocked(node, ids);  // on a connection failure it re-queues what is left
  if (!st.ok()) {
    spdlog::warn("farmem client: freeing leftover leases [{}] on {}: {}",
                 internal::FormatLeaseIds(ids), node.name(), st.ToString());
  }
}

bool Cluster::ProbeLeasesLocked(Node& node, std::span<const uint64_t> ids,
                                std::vector<uint64_t>* held, std::vector<uint64_t>* gone,
                                Status* why) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  for (uint64_t id : ids) {
    uint8_t body[wire::kDataOpSize];
    wire::EncodeDataOp(wire::DataOp{id, 0, 1}, body);
    auto r = CallLocked(node, wire::Opcode::kRead, {body, sizeof body}, QuickCallTimeout());
    if (r) {
      held->push_back(id);
    } else if (!node.conn) {
      return false;
    } else {
      gone->push_back(id);
      if (why->ok()) *why = r.error();
    }
  }
  return true;
}

void Cluster::CheckLeasesHeldLocked(Node& node, uint32_t daemon_count) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    ids.assign(node.leases.begin(), node.leases.end());
  }
  if (ids.empty() || !node.conn) return;
  std::vector<uint64_t> held, gone;
  Status why;
  if (!ProbeLeasesLocked(node, ids, &held, &gone, &why) || gone.empty()) return;
  MutexLock lock(&mu_);
  std::vector<uint64_t> lost;
  for (uint64_t id : gone) {
    if (node.leases.erase(id) == 0) continue;  // freed meanwhile
    node.lost.insert(id);
    node.noticed.erase(id);
    lost.push_back(id);
  }
  if (lost.empty()) return;
  Status reason = Expired(fmt::format(
      "{} is up but holds {} of this client's leases, not {}: it ended leases [{}] (no heartbeat "
      "reached it within its lease TTL of {} ms, or it evicted them): {}",
      node.name(), daemon_count, ids.size(), internal::FormatLeaseIds(lost), node.lease_ttl_ms,
      why.ToString()));
  spdlog::warn("farmem client: {}", reason.message());
  Emit(Event{
      EventType::kLeasesLost, node.id, node.endpoint, std::move(lost), 0, std::move(reason), {}});
}

void Cluster::ReclaimRetainedLocked(Node& node) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    ids.assign(node.retained.begin(), node.retained.end());
  }
  if (ids.empty() || !node.conn) return;
  // The same process answered (Adopt saw its node id): ask it about each lease.
  std::vector<uint64_t> held, gone;
  Status why;
  // The connection failed: the rest stay retained, asked again at the next return.
  if (!ProbeLeasesLocked(node, ids, &held, &gone, &why)) return;
  MutexLock lock(&mu_);
  std::vector<uint64_t> back, lost;
  for (uint64_t id : held) {
    if (node.retained.erase(id) == 0) continue;  // freed meanwhile: it is in to_free
    node.lost.erase(id);
    node.leases.insert(id);
    back.push_back(id);
  }
  for (uint64_t id : gone) {
    if (node.retained.erase(id) > 0) lost.push_back(id);  // stays in `lost` for Free
  }
  if (!back.empty()) {
    spdlog::info(
        "farmem client: {} answered again as the same daemon (node id {:#x}); it still holds "
        "leases [{}]: they were not lost",
        node.name(), node.daemon_id, internal::FormatLeaseIds(back));
    Emit(Event{
        EventType::kLeasesReturned, node.id, node.endpoint, std::move(back), 0, Status::Ok(), {}});
  }
  if (!lost.empty()) {
    Status reason =
        Expired(fmt::format("{} answered again but no longer holds leases [{}]: {}", node.name(),
                            internal::FormatLeaseIds(lost), why.ToString()));
    spdlog::warn("farmem client: {}", reason.message());
    Emit(Event{
        EventType::kLeasesLost, node.id, node.endpoint, std::move(lost), 0, std::move(reason), {}});
  }
}

void Cluster::ExpireRetained(Node& node, std::string_view why) {
  if (node.alive || node.retained.empty() || Clock::now() < node.retained_until) return;
  std::vector<uint64_t> lost(node.retained.begin(), node.retained.end());
  node.retained.clear();
  // Should it answer after all, tell it to let go of them (it has, unless it was stopped).
  node.to_free.insert(node.to_free.end(), lost.begin(), lost.end());
  Status reason = Expired(fmt::format(
      "{} {}: it has ended leases [{}]", node.name(),
      why.empty() ? std::string_view("has not answered for longer than its lease TTL") : why,
      internal::FormatLeaseIds(lost)));
  spdlog::warn("farmem client: {}", reason.message());
  Emit(Event{
      EventType::kLeasesLost, node.id, node.endpoint, std::move(lost), 0, std::move(reason), {}});
}

void Cluster::CollectPushes(Node& node) {
  // Every caller holds call_mu; REQUIRES(node.call_mu) cannot be written in cluster.h, where
  // Node is incomplete.
  node.call_mu.AssertHeld();
  if (!node.conn) return;
  for (const std::vector<uint8_t>& body : node.conn->TakePushes()) {
    auto notice = wire::DecodeEvictNotice(body);
    if (!notice) {
      spdlog::warn("farmem client: bad EVICT_NOTICE from {}: {}", node.name(),
                   notice.error().ToString());
      continue;
    }
    std::vector<wire::NoticedLease> noticed;
    noticed.reserve(notice->lease_ids.size());
    for (uint64_t id : notice->lease_ids) noticed.push_back({id, notice->grace_ms});
    MutexLock lock(&mu_);
    NoteNoticed(node, noticed, /*all=*/true);
  }
}

void Cluster::NoteNoticed(Node& node, std::span<const wire::NoticedLease> noticed, bool all) {
  constexpr std::chrono::seconds kSameNotice{1};
  const Clock::time_point now = Clock::now();
  // One event per grace (a drain notices every lease with one deadline: one event).
  std::map<uint32_t, std::vector<uint64_t>> by_grace;
  if (!all) node.noticed_not_held.clear();
  for (const wire::NoticedLease& n : noticed) {
    if (!node.leases.contains(n.lease_id)) {  // freed meanwhile: needs no move
      if (!all && !node.lost.contains(n.lease_id) &&
          std::ranges::find(node.to_free, n.lease_id) == node.to_free.end()) {
        node.noticed_not_held.push_back(n.lease_id);
      }
      continue;
    }
    const Clock::time_point deadline = now + std::chrono::milliseconds(n.grace_left_ms);
    auto known = node.noticed.find(n.lease_id);
    if (known != node.noticed.end()) {
      // Already under notice: a HEARTBEAT reply only confirms it. A push for it is either the
      // same notice, seen first through a HEARTBEAT reply (its deadline within a second of the
      // known one: not announced twice), or a new, shorter one (announced, deadline moved up).
      if (!all || deadline + kSameNotice >= known->second) {
        known->second = std::min(known->second, deadline);
        continue;
      }
    }
    node.noticed.insert_or_assign(n.lease_id, deadline);
    by_grace[n.grace_left_ms].push_back(n.lease_id);
  }
  for (auto& [grace_ms, held] : by_grace) {
    spdlog::info("farmem client: {} will evict leases [{}] in {} ms{}", node.name(),
                 internal::FormatLeaseIds(held), grace_ms,
                 all ? "" : " (under notice by its HEARTBEAT reply: the notice went elsewhere)");
    Event ev{EventType::kEvictNotice, node.id,  node.endpoint,
             std::move(held),         grace_ms, Status::Ok()};
    ev.deadline = now + std::chrono::milliseconds(grace_ms);
    Emit(std::move(ev));
  }
}

void Cluster::ExpireNoticed(Node& node) {
  // Leases move to `lost` only with call_mu held (node.h); a busy node waits for the next round.
  if (!internal::LockWithin(&node.call_mu, options_.heartbeat_interval)) return;
  MutexLock call(&node.call_mu, kAdoptLock);
  const Clock::time_point now = Clock::now();
  MutexLock lock(&mu_);
  std::vector<uint64_t> ended;
  for (auto it = node.noticed.begin(); it != node.noticed.end();) {
    if (!node.leases.contains(it->first)) {  // freed (moved) in time, or lost otherwise
      it = node.noticed.erase(it);
    } else if (it->second <= now) {
      ended.push_back(it->first);
      node.leases.erase(it->first);
      node.lost.insert(it->first);
      it = node.noticed.erase(it);
    } else {
      ++it;
    }
  }
  if (ended.empty()) return;
  Status reason = Expired(
      fmt::format("{} evicted leases [{}]: they were not freed by the EVICT_NOTICE deadline",
                  node.name(), internal::FormatLeaseIds(ended)));
  spdlog::warn("farmem client: {}", reason.message());
  Emit(Event{
      EventType::kLeasesLost, node.id, node.endpoint, std::move(ended), 0, std::move(reason), {}});
}

}  // namespace farmem::client
