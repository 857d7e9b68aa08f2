// RemoteStore re-protection: the periodic reconcile of members against the cluster's view, and
// rebuilding a failed member's cells on another daemon (Reprotect). Failures are noted
// (MarkFailed, OnClusterEvent) and the recovery thread's loop runs in remote_store.cc; the data
// path is in remote_store_io.cc.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "farmem/spanstore/remote_store.h"

namespace farmem::spanstore {

void RemoteStore::ReconcileMembers() {
  const std::vector<client::NodeInfo> nodes = cluster_->nodes();
  struct Hit {
    Group* group;
    int member;
    uint64_t lease;
    Status why;
  };
  std::vector<Hit> hits;
  {
    MutexLock lock(&mu_);
    for (auto& g : groups_) {
      for (size_t m = 0; m < g->members.size(); ++m) {
        const client::Lease& l = g->members[m];
        if (Vacant(l) || (((g->failed_mask | g->lost_mask) >> m) & 1) != 0) continue;
        if (l.node >= nodes.size()) continue;
        const client::NodeInfo& info = nodes[l.node];
        if (!info.alive) {
          hits.push_back(
              {g.get(), static_cast<int>(m), l.id(),
               Unavailable(fmt::format("reconcile: daemon {} is down ({})",
                                       info.endpoint.ToString(), info.last_error.ToString()))});
        } else if (g->daemon_ids[m] != 0 && info.daemon_id != 0 &&
                   info.daemon_id != g->daemon_ids[m]) {
          hits.push_back(
              {g.get(), static_cast<int>(m), l.id(),
               Expired(fmt::format("reconcile: daemon {} restarted (node id {:#x} -> "
                                   "{:#x}): its leases are gone",
                                   info.endpoint.ToString(), g->daemon_ids[m], info.daemon_id))});
        }
      }
    }
  }
  for (const Hit& h : hits) MarkFailed(h.group, h.member, h.lease, h.why);
}

void RemoteStore::SetLostObserver(LostObserver observer) {
  MutexLock lock(&mu_);
  lost_observer_ = std::move(observer);
}

// Rebuilds every failed member of `g` on a live daemon that holds none of the group's surviving
// members (the failed member's own daemon qualifies once it is back, e.g. restarted empty). Runs
// on the recovery thread with g->in_recovery set (g is not freed). While a member's cells are
// rebuilt g->rebuilding is set: no new rows are placed in g, and rows reserved before and
// committed after see the flag (or the new epoch) and go elsewhere.
void RemoteStore::Reprotect(IoContext& io, Group* g) {
  const int n = res_.group_size();
  const size_t span = span_size_;
  if (io.scratch.size() < span * static_cast<size_t>(n)) io.scratch.resize(span * n);
  std::vector<client::Lease> members;
  uint32_t failed = 0;
  uint32_t lost = 0;
  uint32_t evicted = 0;
  size_t used_rows = 0;
  {
    MutexLock lock(&mu_);
    // Members that failed on an op, or with their daemon declared down, whose daemon answers
    // again with the lease and that missed nothing: used again rather than rebuilt.
    for (int m = 0; m < n; ++m) {
      if (((g->failed_mask >> m) & 1) != 0) (void)RevalidateLocked(g, m);
    }
    members = g->members;
    failed = g->failed_mask;
    lost = g->lost_mask;
    evicted = g->evicted_mask;
    used_rows = g->used_rows;
  }
  const uint32_t all = n >= 32 ? ~0u : ((1u << n) - 1);
  const uint32_t live = all & ~failed & ~lost;
  const bool recoverable = res_.mode == client::Resilience::Mode::kErasure
                               ? std::popcount(live) >= res_.k
                               : (res_.mode == client::Resilience::Mode::kReplicate && live != 0);
  if (!recoverable) {
    // Nothing else holds the data. A member whose lease may still come back (its daemon was
    // declared down but may answer again as the same process) is waited for: giving it up now
    // would turn a false down into lost objects. Derefs of its sets fail meanwhile; the cluster
    // says kLeasesReturned or kLeasesLost (then the next pass gives it up).
    for (int m = 0; m < n; ++m) {
      if (((failed >> m) & 1) == 0 || Vacant(members[static_cast<size_t>(m)])) continue;
      if (cluster_->GetLeaseState(members[static_cast<size_t>(m)]) != client::LeaseState::kGone) {
        return;
      }
    }
    std::vector<SpanOwner*> lost_spans;
    LostObserver observer;
    uint32_t group_id = 0;
    {
      MutexLock lock(&mu_);
      g->lost_mask |= failed;
      g->failed_mask = 0;
      for (uint32_t r = 0; r < rows_per_group_;
           ++r) {  // the live data cells on the members given up
        const SpanSet* set = &g->sets[r];
        if (set->group == nullptr) continue;
        const uint32_t gone = set->live_mask & failed;
        lost_bytes_ += std::popcount(gone) * uint64_t{span};
        for (int m = 0; m < res_.k; ++m) {
          if (((gone >> m) & 1) != 0 && set->spans[static_cast<size_t>(m)] != nullptr) {
            lost_spans.push_back(set->spans[static_cast<size_t>(m)]);
          }
        }
      }
      spdlog::error(
          "far memory: slab group {} lost members {:#x}: {} span sets cannot be rebuilt with "
          "resilience {}; {}",
          g->id, failed, g->used_rows, res_.ToString(),
          // farmem-nbd's stripe layout names the pages (and says whether its backup file has
          // them); far_ptr's deref names each object.
          lost_observer_ ? "the borrower names what lived only there"
                         : "objects that were only there are LOST (deref says which)");
      observer = lost_observer_;
      group_id = g->id;
    }
    if (observer && !lost_spans.empty()) observer(group_id, lost_spans);
    return;
  }
  // Survivors to read: the first k live members (ec) or one live copy (replicate).
  std::vector<int> readers;
  for (int m = 0; m < n; ++m) {
    if (((live >> m) & 1) != 0) readers.push_back(m);
  }
  readers.resize(res_.mode == client::Resilience::Mode::kErasure ? static_cast<size_t>(res_.k) : 1);
  // A replacement may share a daemon with no surviving member, nor with another replacement.
  std::vector<client::NodeId> exclude;
  for (int m = 0; m < n; ++m) {
    if (((live >> m) & 1) != 0) exclude.push_back(members[static_cast<size_t>(m)].node);
  }

  // Rebuilds member j's cell of `row` from the readers and writes it at the same offset of
  // `fresh`. *stale: a failure was a stale channel's (worth another try at once).
  auto rebuild_row = [&](int j, const client::Lease& fresh, uint32_t row, bool* stale) -> Status {
    const uint64_t off = static_cast<uint64_t>(row) * span;
    transport::Op ops[kMaxSetWidth];
    client::NodeId nodes[kMaxSetWidth];
    Status results[kMaxSetWidth];
    for (size_t i = 0; i < readers.size(); ++i) {
      const int m = readers[i];
      ops[i] = {transport::OpType::kRead,
                members[static_cast<size_t>(m)].slab(),
                off,
                io.scratch.data() + static_cast<size_t>(m) * span,
                static_cast<uint32_t>(span),
                nullptr,
                0};
      nodes[i] = members[static_cast<size_t>(m)].node;
    }
    RunOps(io, {ops, readers.size()}, {nodes, readers.size()}, {results, readers.size()});
    Status s;
    for (size_t i = 0; i < readers.size(); ++i) {
      if (results[i].ok()) continue;
      if (s.ok()) s = results[i];
      if (StaleChannel(io, nodes[i])) {
        *stale = true;
        continue;
      }
      cluster_->ReportFailure(nodes[i], results[i]);
      if (NodeGone(results[i])) {
        MarkFailed(g, readers[i], members[static_cast<size_t>(readers[i])].id(), results[i]);
      }
    }
    if (!s.ok()) return s;
    uint8_t* cell = io.scratch.data() + static_cast<size_t>(j) * span;
    if (res_.mode == client::Resilience::Mode::kErasure) {
      uint8_t* frags[kMaxSetWidth];
      std::vector<int> erased;
      for (int m = 0; m < n; ++m) {
        frags[m] = io.scratch.data() + static_cast<size_t>(m) * span;
        if (std::find(readers.begin(), readers.end(), m) == readers.end()) erased.push_back(m);
      }
      if (Status d = codec_->Decode({frags, static_cast<size_t>(n)}, erased, span); !d.ok()) {
        return d;
      }
    } else {
      std::memcpy(cell, io.scratch.data() + static_cast<size_t>(readers[0]) * span, span);
    }
    transport::Op w{transport::OpType::kWrite,   fresh.slab(), off, cell,
                    static_cast<uint32_t>(span), nullptr,      0};
    client::NodeId wn = fresh.node;
    Status ws;
    RunOps(io, {&w, 1}, {&wn, 1}, {&ws, 1});
    if (!ws.ok() && StaleChannel(io, wn)) *stale = true;
    return ws;
  };

  for (int j = 0; j < n; ++j) {
    if (((failed >> j) & 1) == 0) continue;
    const client::Lease& was = members[static_cast<size_t>(j)];
    {
      // Its daemon may have answered with the lease since the look above (a node-up starts a
      // pass while the cluster is still asking it): a member that missed nothing is used again
      // as it is, decided here where the rebuild would start, never copied to a fresh lease.
      MutexLock lock(&mu_);
      if (RevalidateLocked(g, j)) {
        EndEpisodeIfWholeLocked();
        continue;
      }
    }
    if (!Vacant(was) && cluster_->GetLeaseState(was) == client::LeaseState::kRetained &&
        cluster_->node(was.node).alive) {
      continue;  // its daemon answers again and is being asked for the lease: wait for that
    }
    std::vector<client::NodeId> avoid = exclude;
    if (((evicted >> j) & 1) != 0) avoid.push_back(members[static_cast<size_t>(j)].node);
    Result<client::Lease> fresh = cluster_->AllocateExcluding(avoid);
    if (!fresh) {
      if (!g->degraded_logged) {
        g->degraded_logged = true;
        spdlog::warn(
            "far memory: slab group {} runs degraded (member {} missing, {} span sets): no "
            "daemon outside the group can take it yet ({}); re-protecting when one comes up",
            g->id, j, used_rows, fresh.error().ToString());
      }
      continue;
    }
    const Clock::time_point rebuild_start = Clock::now();
    std::vector<uint32_t> rows;
    {
      MutexLock lock(&mu_);
      rows = StartRebuildLocked(g);
    }
    Status s;
    bool stale = false;
    for (uint32_t row : rows) {
      s = rebuild_row(j, *fresh, row, &stale);
      if (!s.ok() && stale) s = rebuild_row(j, *fresh, row, &stale);  // reopened channels
      if (!s.ok()) break;
    }
    if (!s.ok()) {
      {
        MutexLock lock(&mu_);
        g->rebuilding = false;
        ++copies_abandoned_;
        if (stale) QueueLocked(g);  // try again at once rather than at the next tick
      }
      spdlog::warn("far memory: re-protecting slab group {} member {} failed: {}", g->id, j,
                   s.ToString());
      (void)cluster_->Free({&*fresh, 1});
      if (NodeGone(s)) return;  // a survivor failed: the next pass starts from the new masks
      continue;
    }
    const uint64_t daemon_id = cluster_->node(fresh->node).daemon_id;
    const Clock::time_point now = Clock::now();
    client::Lease old;
    uint64_t degraded_ms = 0;
    {
      MutexLock lock(&mu_);
      old = g->members[static_cast<size_t>(j)];
      InstallMemberLocked(g, j, *fresh, daemon_id);
      g->degraded_logged = false;
      g->rebuilding = false;
      ++reprotected_;
      rebuilt_bytes_ += rows.size() * uint64_t{span};
      episode_bytes_ += rows.size() * uint64_t{span};
      reprotect_since_ = std::min(reprotect_since_, rebuild_start);
      if (g->failed_mask == 0) {
        sets_reprotected_ += g->used_rows;
        episode_sets_ += g->used_rows;
      }
      degraded_ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              now - g->failed_since[static_cast<size_t>(j)])
                                              .count());
      reprotect_last_ms_ = degraded_ms;
      reprotect_max_ms_ = std::max(reprotect_max_ms_, degraded_ms);
    }
    exclude.push_back(fresh->node);
    if (!Vacant(old)) (void)cluster_->Free({&old, 1});
    spdlog::info(
        "far memory: slab group {} member {} re-protected on {} ({} span sets rebuilt in {} ms; "
        "{} ms after it went missing)",
        g->id, j, cluster_->node(fresh->node).endpoint.ToString(), rows.size(),
        std::chrono::duration_cast<std::chrono::milliseconds>(now - rebuild_start).count(),
        degraded_ms);
  }
}

}  // namespace farmem::spanstore
