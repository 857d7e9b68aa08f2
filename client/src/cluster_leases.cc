// Leases: which daemons get a slab (power-of-two choices; the pure choice is placement.cc), for
// single slabs, all-or-nothing batches and groups on distinct daemons; and giving them back.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>

#include "farmem/client/cluster.h"
#include "node.h"

namespace farmem::client {

// One slab by power-of-two-choices among live nodes not in `exclude`: two sampled at random
// among the healthy ones, the one with more free slabs first; if both are full or fail, every
// other live node, most free first, the suspect ones last. The error says what each daemon
// answered.
Result<Lease> Cluster::PlaceOne(const std::vector<bool>& exclude) {
  std::vector<NodeId> candidates;  // healthy ones first, then suspect ones
  size_t n_healthy = 0;
  std::vector<NodeId> picks;
  {
    MutexLock lock(&mu_);
    // Nodes whose data path failed lately come last (ReportFailure): the two choices are among
    // the others, and a suspect node is tried only when no other can take the slab.
    const Clock::time_point now = Clock::now();
    std::vector<NodeId> suspect;
    for (const auto& n : nodes_) {
      if (!n->alive || Excluded(exclude, n->id)) continue;
      (now < n->suspect_until ? suspect : candidates).push_back(n->id);
    }
    picks = SampleDistinct(candidates, 2, rng_);
    n_healthy = candidates.size();
    std::shuffle(suspect.begin(), suspect.end(), rng_);
    candidates.insert(candidates.end(), suspect.begin(), suspect.end());
  }
  // Two choices first; if both are full or fail, every other live node, most free first, the
  // suspect ones last.
  PlacementLog log;
  if (auto lease = TryPlaceOn(picks, &log)) return *lease;
  std::vector<NodeId> rest;
  for (size_t i = 0; i < n_healthy; ++i) {
    const NodeId id = candidates[i];
    if (id >= log.tried.size() || !log.tried[id]) rest.push_back(id);
  }
  std::vector<NodeId> rest_suspect;
  for (size_t i = n_healthy; i < candidates.size(); ++i) {
    const NodeId id = candidates[i];
    if (id >= log.tried.size() || !log.tried[id]) rest_suspect.push_back(id);
  }
  {
    MutexLock lock(&mu_);
    std::shuffle(rest.begin(), rest.end(), rng_);  // ties among the rest broken at random
  }
  if (auto lease = TryPlaceOn(rest, &log)) return *lease;
  if (auto lease = TryPlaceOn(rest_suspect, &log)) return *lease;
  return Err(PlacementFailure(exclude, log));
}

bool Cluster::Excluded(const std::vector<bool>& exclude, NodeId id) {
  return id < exclude.size() && exclude[id];
}

std::optional<Lease> Cluster::TryPlaceOn(std::span<const NodeId> sampled, PlacementLog* log) {
  std::vector<PlacementChoice> choices;
  for (NodeId id : sampled) {
    Node* node = FindNode(id);
    if (node == nullptr) continue;
    auto stat = StatNode(*node);
    if (stat) {
      // What this client may still take there (its --max-client-share), not the pool's free.
      const uint32_t free = wire::FreeForClient(*stat);
      choices.push_back({id, free, true});
      log->seen[id] =
          free == stat->free_slabs
              ? fmt::format("free={}", free)
              : fmt::format("free={} for this client ({} in the pool)", free, stat->free_slabs);
    } else {
      choices.push_back({id, 0, false});
      log->seen[id] = fmt::format("unreachable ({})", stat.error().ToString());
      log->alloc_failed = true;
    }
    if (id >= log->tried.size()) log->tried.resize(id + 1, false);
    log->tried[id] = true;
  }
  for (NodeId id : RankByFreeSlabs(choices)) {
    auto lease = AllocOn(*FindNode(id));
    if (lease) return *lease;
    log->seen[id] += fmt::format(" but ALLOC failed ({})", lease.error().ToString());
    if (lease.error().code() != StatusCode::kResourceExhausted) log->alloc_failed = true;
  }
  return std::nullopt;
}

Status Cluster::PlacementFailure(const std::vector<bool>& exclude, const PlacementLog& log) const {
  std::string counts;
  bool any_alive = false;
  {
    MutexLock lock(&mu_);
    for (const auto& n : nodes_) {
      any_alive = any_alive || n->alive;
      if (!counts.empty()) counts += ", ";
      counts += n->endpoint.ToString() + " ";
      if (Excluded(exclude, n->id)) {
        counts += "already in the group";
      } else if (auto it = log.seen.find(n->id); it != log.seen.end()) {
        counts += it->second;
      } else {
        counts += n->alive ? "not asked" : "down";
      }
    }
  }
  // Full means every daemon asked said so; if one failed or none was up, a retry may succeed.
  if (!any_alive) return Unavailable("no daemon is up: " + counts);
  if (log.alloc_failed) return Unavailable("no daemon could grant a slab: " + counts);
  return ResourceExhausted("no daemon has a free slab: " + counts);
}

Result<std::vector<Lease>> Cluster::Allocate(size_t n) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  std::vector<Lease> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto lease = PlaceOne({});
    if (!lease) {
      (void)Free(out);  // all or nothing; what cannot be freed now is freed in the background
      return Err(
          lease.error().WithContext(n == 1 ? std::string("allocating a slab")
                                           : fmt::format("allocating slab {} of {}", i + 1, n)));
    }
    out.push_back(*lease);
  }
  return out;
}

Result<std::vector<Lease>> Cluster::AllocateGroup(size_t n) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  if (n == 0) return std::vector<Lease>{};
  std::string down;
  size_t total = 0;
  size_t alive = 0;
  {
    MutexLock lock(&mu_);
    total = nodes_.size();
    for (const auto& node : nodes_) {
      if (node->alive) {
        ++alive;
      } else {
        down += (down.empty() ? "" : ", ") + node->endpoint.ToString();
      }
    }
  }
  if (n > total) {
    return Err(InvalidArgument(fmt::format(
        "a group of {} slabs needs {} distinct nodes, but the cluster has only {}", n, n, total)));
  }
  if (n > alive) {
    return Err(ResourceExhausted(
        fmt::format("a group of {} slabs needs {} distinct live nodes, but only {} of {} are up "
                    "(down: {})",
                    n, n, alive, total, down)));
  }
  std::vector<Lease> out;
  out.reserve(n);
  std::vector<bool> exclude(total, false);
  for (size_t i = 0; i < n; ++i) {
    auto lease = PlaceOne(exclude);
    if (!lease) {
      (void)Free(out);
      return Err(lease.error().WithContext(
          fmt::format("placing slab {} of a group of {} on distinct nodes", i + 1, n)));
    }
    if (lease->node >= exclude.size()) exclude.resize(lease->node + 1, false);
    exclude[lease->node] = true;
    out.push_back(*lease);
  }
  return out;
}

Result<Lease> Cluster::AllocateExcluding(std::span<const NodeId> exclude) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  std::vector<bool> excluded;
  for (NodeId id : exclude) {
    if (id >= excluded.size()) excluded.resize(id + 1, false);
    excluded[id] = true;
  }
  return PlaceOne(excluded);
}

// ---- adopting ----

Result<std::vector<uint64_t>> Cluster::AdoptLeases(NodeId id, std::span<const uint64_t> lease_ids) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  Node* node = FindNode(id);
  if (node == nullptr) {
    return Err(NotFound(fmt::format("node {}: the cluster has only {}", id, node_count())));
  }
  MutexLock call(&node->call_mu);
  if (!node->conn) {
    return Err(Unavailable(
        fmt::format("{} is not connected: its leases cannot be adopted", node->name())));
  }
  std::vector<uint64_t> held, gone;
  Status why;
  if (!ProbeLeasesLocked(*node, lease_ids, &held, &gone, &why)) {
    return Err(Unavailable(fmt::format("{}: the connection failed while checking leases {}",
                                       node->name(), internal::FormatLeaseIds(lease_ids))));
  }
  MutexLock lock(&mu_);
  for (uint64_t lease_id : held) {
    node->leases.insert(lease_id);
    node->accesses->Track(lease_id);
    std::erase(node->noticed_not_held, lease_id);
  }
  return gone;
}

// ---- freeing ----

Status Cluster::Free(std::span<const Lease> leases) {
  FARMEM_RETURN_IF_ERROR(CheckOpen());
  std::map<NodeId, std::vector<uint64_t>> by_node;
  for (const Lease& l : leases) by_node[l.node].push_back(l.grant.lease_id);

  Status first;
  auto note = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  for (auto& [id, ids] : by_node) {
    Node* node = FindNode(id);
    if (node == nullptr) {
      note(NotFound(fmt::format("leases {} name node {}, but the cluster has only {}",
                                internal::FormatLeaseIds(ids), id, node_count())));
      continue;
    }
    std::vector<uint64_t> send;
    std::vector<uint64_t> unknown;
    // None of them held there (lost with the node, or unknown): nothing to send, so do not wait
    // for call_mu, which a reconnect to a hung daemon holds for up to connect_timeout.
    bool nothing_to_send = false;
    auto note_unknown = [&] {
      if (unknown.empty()) return;
      note(
          NotFound(fmt::format("leases {} on {} are not held by this client (never granted or "
                               "already freed)",
                               internal::FormatLeaseIds(unknown), node->name())));
    };
    {
      MutexLock lock(&mu_);
      nothing_to_send =
          std::ranges::none_of(ids, [&](uint64_t l) { return node->leases.contains(l); });
      if (nothing_to_send) {
        for (uint64_t lease_id : ids) {
          if (node->lost.erase(lease_id) == 0) {
            unknown.push_back(lease_id);
          } else if (node->retained.erase(lease_id) > 0) {
            // Its daemon was declared down but may still hold it: FREE it once it answers.
            node->to_free.push_back(lease_id);
          }
        }
      }
    }
    if (nothing_to_send) {
      note_unknown();
      continue;
    }
    MutexLock call(&node->call_mu);
    {
      MutexLock lock(&mu_);
      for (uint64_t lease_id : ids) {
        if (node->leases.erase(lease_id) > 0) {
          send.push_back(lease_id);
        } else if (node->lost.erase(lease_id) == 0) {
          unknown.push_back(lease_id);
        } else if (node->retained.erase(lease_id) > 0) {
          node->to_free.push_back(lease_id);
        }
      }
      if (!send.empty() && !node->conn) {
        node->to_free.insert(node->to_free.end(), send.begin(), send.end());
      }
    }
    note_unknown();
    if (send.empty()) continue;
    if (!node->conn) {
      note(
          Unavailable(fmt::format("cannot free leases {} now: {} is not connected; they will be "
                                  "freed when it answers",
                                  internal::FormatLeaseIds(send), node->name())));
      continue;
    }
    Status st = SendFreeLocked(*node, send);
    if (!st.ok()) {
      note(st.WithContext(fmt::format("freeing leases {}{}", internal::FormatLeaseIds(send),
                                      node->conn ? "" : " (retried when the node answers)")));
    }
  }
  return first;
}

}  // namespace farmem::client
