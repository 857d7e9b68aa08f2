// Failures, rebuild and re-protection: cluster events, the rebuild thread (RebuildLoop),
// rebuilding an extent's failed members on other daemons (RebuildExtent; the member copy itself
// is page_store_move.cc), the degraded-episode bookkeeping and the capacity check.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "export_capacity.h"
#include "page_store.h"
#include "page_store_round.h"

namespace farmem::blockdev {

using namespace pagestore;

// ---------------------------------------------------------------------------------------------
// Failures and rebuild

void PageStore::OnClusterEvent(const client::Event& ev) {
  HandleClusterEvent(ev);
  // The lease states the event reports are the cluster's already: a request waiting for
  // members looks again (and again once the rebuild thread has acted on it).
  NoteMembersChanged();
}

void PageStore::HandleClusterEvent(const client::Event& ev) {
  if (ev.type == client::EventType::kNodeUp) {
    // A daemon returned, restarted empty, or joined: it may take what degraded extents miss.
    RequestReconcile();
    return;
  }
  if (ev.lease_ids.empty()) return;
  if (ev.type == client::EventType::kLeasesReturned) {
    // The daemon was declared down but was not lost: the rebuild thread takes back the members
    // that no rebuild replaced and no write went past (Revalidate).
    {
      MutexLock lock(&rebuild_mu_);
      for (uint64_t id : ev.lease_ids) returned_leases_.push_back({ev.node, id});
    }
    rebuild_cv_.SignalAll();
    return;
  }
  if (ev.type == client::EventType::kEvictNotice) {
    // Leaving, not lost: moved by the rebuild thread while still readable (MoveLeaving).
    {
      MutexLock lock(&rebuild_mu_);
      const Clock::time_point now = Clock::now();
      for (uint64_t id : ev.lease_ids) noticed_.push_back({ev.node, id, ev.deadline, now});
    }
    rebuild_cv_.SignalAll();
    return;
  }
  if (ev.type != client::EventType::kNodeDown && ev.type != client::EventType::kLeasesLost) {
    return;
  }
  std::vector<LostLease> lost;
  for (uint64_t id : ev.lease_ids) lost.push_back({ev.node, id});
  // Fail those members now, where no extent lock is in the way: rounds from here on leave them
  // out instead of each finding the daemon gone (and rebuilding on the request path). The
  // rebuild thread marks the rest and queues the rebuilds.
  MarkLost(lost, /*wait=*/false);
  {
    MutexLock lock(&rebuild_mu_);
    lost_leases_.insert(lost_leases_.end(), lost.begin(), lost.end());
  }
  rebuild_cv_.SignalAll();
}

void PageStore::MarkLost(std::span<const LostLease> lost, bool wait) {
  for (uint64_t index = 0; index < extents_.size(); ++index) {
    Extent& e = *extents_[index];
    if (wait) {
      e.mu.LockShared();
    } else if (!e.mu.TryLockShared()) {
      continue;  // held exclusively now: the rebuild thread's pass marks it
    }
    uint32_t bits = 0;
    if (e.mapped.load()) {
      for (size_t j = 0; j < e.members.size(); ++j) {
        const client::Lease& m = e.members[j];
        // Lease ids are the daemon's: match the node too.
        if (std::any_of(lost.begin(), lost.end(),
                        [&](const LostLease& l) { return l.node == m.node && l.id == m.id(); })) {
          bits |= 1u << j;
        }
      }
      if (bits != 0) e.failed.fetch_or(bits);
    }
    e.mu.UnlockShared();
    if (bits != 0) {
      NoteDegraded();
      if (wait) QueueRebuild(index);
    }
  }
}

bool PageStore::MayRevalidate(const Extent& e, size_t j) const {
  const client::Lease& m = e.members[j];
  if (IsVacant(m) || !((e.failed.load() >> j) & 1) || ((e.stale.load() >> j) & 1)) return false;
  if (cluster_->GetLeaseState(m) != client::LeaseState::kHeld) return false;
  const client::NodeInfo node = cluster_->node(m.node);
  return node.alive && !node.suspect;
}

bool PageStore::MembersMayReturn(const Extent& e) const {
  const uint32_t failed = e.failed.load();
  for (size_t j = 0; j < e.members.size(); ++j) {
    const client::Lease& m = e.members[j];
    if (!((failed >> j) & 1) || IsVacant(m) || ((e.stale.load() >> j) & 1)) continue;
    if (cluster_->GetLeaseState(m) != client::LeaseState::kGone) return true;
  }
  return false;
}

bool PageStore::WaitForMembers(std::span<Extent* const> extents, Clock::time_point deadline) const {
  auto waiting = [&](Extent* e) {
    ReaderLock lock(&e->mu);
    if (!e->mapped.load()) return false;
    const int live = std::popcount(e->live_mask());
    return live < MinMembers() && MembersMayReturn(*e);
  };
  // The answer comes from the cluster's thread (kLeasesReturned, kLeasesLost, node up or down)
  // and the rebuild thread (Revalidate, rebuilds): both call NoteMembersChanged. The extents are
  // looked at without rebuild_mu_ (extent locks are never taken under it); the change count
  // read before the look says whether anything happened since.
  for (;;) {
    uint64_t seen = 0;
    {
      MutexLock lock(&rebuild_mu_);
      if (stopping_) return false;
      seen = member_changes_;
    }
    if (std::none_of(extents.begin(), extents.end(), waiting)) return true;
    MutexLock lock(&rebuild_mu_);
    if (!members_cv_.WaitUntil(&rebuild_mu_, deadline, [&] {
          rebuild_mu_.AssertHeld();
          return stopping_ || member_changes_ != seen;
        })) {
      lock.Unlock();
      // One last look: the deadline may have come with the answer.
      return std::none_of(extents.begin(), extents.end(), waiting);
    }
  }
}

void PageStore::NoteMembersChanged() {
  {
    MutexLock lock(&rebuild_mu_);
    ++member_changes_;
  }
  members_cv_.SignalAll();
}

std::chrono::milliseconds PageStore::MemberReturnWait() const {
  // farmemd's default lease TTL when no daemon said one yet.
  std::chrono::milliseconds ttl{10000};
  for (const client::NodeInfo& n : cluster_->nodes()) {
    ttl = std::max(ttl, std::chrono::milliseconds(n.lease_ttl_ms));
  }
  return ttl + options_.reconcile_interval;
}

uint64_t PageStore::RevalidateExtent(Extent& e, std::span<const LostLease> only) {
  WriterLock ex(&e.mu);  // no round is running: none can go past a member while it comes back
  if (!e.mapped.load()) return 0;
  uint64_t n = 0;
  for (size_t j = 0; j < e.members.size(); ++j) {
    const client::Lease& m = e.members[j];
    if (!only.empty() && std::none_of(only.begin(), only.end(), [&](const LostLease& l) {
          return l.node == m.node && l.id == m.id();
        })) {
      continue;
    }
    if (!MayRevalidate(e, j)) continue;
    e.failed.fetch_and(~(1u << j));
    ++n;
  }
  return n;
}

void PageStore::Revalidate(std::span<const LostLease> returned) {
  uint64_t back = 0, stale = 0;
  for (uint64_t index = 0; index < extents_.size(); ++index) {
    Extent& e = *extents_[index];
    bool mine = false;
    {
      ReaderLock lock(&e.mu);
      if (!e.mapped.load()) continue;
      for (size_t j = 0; j < e.members.size(); ++j) {
        const client::Lease& m = e.members[j];
        if (std::any_of(returned.begin(), returned.end(),
                        [&](const LostLease& l) { return l.node == m.node && l.id == m.id(); })) {
          mine = true;
          if (((e.failed.load() >> j) & 1) && ((e.stale.load() >> j) & 1)) ++stale;
        }
      }
    }
    if (mine) back += RevalidateExtent(e, returned);
    if (mine && e.failed.load() != 0) QueueRebuild(index);  // stale members: rebuild them now
  }
  CountStat(&PageStoreStats::revalidated_members, back);
  spdlog::info(
      "page store: {} leases came back with their daemon (it was declared down but not lost): "
      "{} members in use again as they were, {} missed writes while down and are rebuilt",
      returned.size(), back, stale);
}

void PageStore::QueueRebuild(uint64_t index) {
  {
    MutexLock lock(&rebuild_mu_);
    rebuild_queue_.push_back(index);
  }
  rebuild_cv_.SignalAll();
}

void PageStore::RequestReconcile() {
  {
    MutexLock lock(&rebuild_mu_);
    reconcile_requested_ = true;
  }
  rebuild_cv_.SignalAll();
}

void PageStore::WaitForRebuilds() {
  MutexLock lock(&rebuild_mu_);
  rebuild_cv_.Wait(&rebuild_mu_, [&] {
    rebuild_mu_.AssertHeld();
    return stopping_ || (rebuild_queue_.empty() && lost_leases_.empty() && noticed_.empty() &&
                         returned_leases_.empty() && !reconcile_requested_ && !rebuilding_);
  });
}

void PageStore::RebuildLoop() {
  Worker& w = workers_.background();
  MutexLock lock(&rebuild_mu_);
  Clock::time_point next_reconcile = Clock::now() + options_.reconcile_interval;
  // Moves that could not be done yet (no room, a copy failed) are retried this often until their
  // deadline: room may be freed, a daemon may come up.
  constexpr std::chrono::milliseconds kMoveRetry{200};
  Clock::time_point next_move_try = Clock::time_point::max();
  for (;;) {
    rebuild_cv_.WaitUntil(&rebuild_mu_, std::min(next_reconcile, next_move_try), [&] {
      rebuild_mu_.AssertHeld();
      return stopping_ || !rebuild_queue_.empty() || !lost_leases_.empty() || !noticed_.empty() ||
             !returned_leases_.empty() || reconcile_requested_;
    });
    if (stopping_) return;
    const bool periodic = Clock::now() >= next_reconcile;
    const bool all = periodic || reconcile_requested_;
    reconcile_requested_ = false;
    rebuilding_ = true;
    std::vector<LostLease> lost;
    lost.swap(lost_leases_);
    std::vector<NoticedLease> noticed;
    noticed.swap(noticed_);
    std::vector<LostLease> returned;
    returned.swap(returned_leases_);
    lock.Unlock();
    if (!lost.empty()) MarkLost(lost, /*wait=*/true);
    if (!returned.empty()) Revalidate(returned);
    if (!noticed.empty()) MarkLeaving(noticed);
    // Moves first: they have a deadline, and a leaving member left unmoved becomes a lost one.
    next_move_try = Clock::time_point::max();
    if (MoveLeaving(w)) next_move_try = Clock::now() + kMoveRetry;
    lock.Lock();
    std::vector<uint64_t> todo(rebuild_queue_.begin(), rebuild_queue_.end());
    rebuild_queue_.clear();
    lock.Unlock();
    Reprotect(w, std::move(todo), all);
    if (periodic) {
      CheckCapacity();
      FlushLostPages(/*force=*/false);
      next_reconcile = Clock::now() + options_.reconcile_interval;
    }
    lock.Lock();
    rebuilding_ = false;
    ++member_changes_;  // members revalidated or rebuilt: a WaitForMembers looks again
    rebuild_cv_.SignalAll();
    members_cv_.SignalAll();
  }
}

// ---------------------------------------------------------------------------------------------
// Re-protection

uint64_t PageStore::CountDegraded() const {
  uint64_t n = 0;
  for (const auto& e : extents_) n += e->mapped.load() && e->failed.load() != 0 ? 1 : 0;
  return n;
}

void PageStore::NoteDegraded() {
  MutexLock lock(&stats_mu_);
  if (degraded_since_ == Clock::time_point::max()) {
    degraded_since_ = Clock::now();
    stats_.degraded_episodes += 1;
    episode_revalidated_from_ = stats_.revalidated_members;
  }
}

void PageStore::NoteRebuilt(uint64_t bytes, bool extent_whole, Clock::time_point started) {
  MutexLock lock(&stats_mu_);
  stats_.rebuilds += 1;
  stats_.rebuilt_bytes += bytes;
  stats_.reprotected_extents += extent_whole ? 1 : 0;
  episode_bytes_ += bytes;
  episode_extents_ += extent_whole ? 1 : 0;
  reprotect_since_ = std::min(reprotect_since_, started);
}

void PageStore::Reprotect(Worker& w, std::vector<uint64_t> todo, bool all) {
  if (all) {
    for (uint64_t i = 0; i < extents_.size(); ++i) {
      if (extents_[i]->mapped.load() && extents_[i]->failed.load() != 0) todo.push_back(i);
    }
  }
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  // Members that failed on the data path while their daemon stayed up (a slow moment, a daemon
  // declared down and back between two looks) and that missed no write are used again rather
  // than rebuilt, once their daemon answers and is no longer suspect.
  uint64_t back = 0;
  for (uint64_t index : todo) {
    Extent& e = *extents_[index];
    bool any = false;
    {
      ReaderLock lock(&e.mu);
      if (!e.mapped.load()) continue;
      for (size_t j = 0; j < e.members.size(); ++j) any = any || MayRevalidate(e, j);
    }
    if (any) back += RevalidateExtent(e, {});
  }
  if (back > 0) {
    CountStat(&PageStoreStats::revalidated_members, back);
    spdlog::info("page store: {} members whose daemon answers again are in use again", back);
  }
  if (!todo.empty()) {
    // A member can only go to a daemon that is up and holds no other member of its group. Ask
    // only where one exists, and, within this pass, not again where every such daemon said full.
    const std::vector<client::NodeInfo> nodes = cluster_->nodes();
    std::vector<bool> full(nodes.size(), false);
    std::vector<client::NodeId> candidates;
    for (uint64_t index : todo) {
      {
        MutexLock lock(&rebuild_mu_);
        if (stopping_) return;  // shutting down: do not start another rebuild
      }
      Extent& e = *extents_[index];
      candidates.clear();
      {
        ReaderLock lock(&e.mu);
        const uint32_t failed = e.failed.load();
        if (!e.mapped.load() || failed == 0) continue;
        for (const client::NodeInfo& n : nodes) {
          if (!n.alive || full[n.id]) continue;
          bool member = false;
          for (size_t j = 0; j < e.members.size(); ++j) {
            member = member || (!((failed >> j) & 1) && e.members[j].node == n.id);
          }
          if (!member) candidates.push_back(n.id);
        }
      }
      if (candidates.empty()) continue;  // stays degraded; a node-up event or the next pass retries
      Status s = RebuildExtent(w, index);
      if (s.code() == StatusCode::kResourceExhausted) {
        for (client::NodeId id : candidates) full[id] = true;
      }
    }
  }
  // Whole again? End the episode: say how long it was degraded and how long re-protecting took.
  if (const uint64_t degraded = CountDegraded(); degraded != 0) {
    uint64_t missing = 0;
    for (const auto& e : extents_) {
      if (e->mapped.load()) missing += static_cast<uint64_t>(std::popcount(e->failed.load()));
    }
    if (uint64_t left_out = 0; StillDegradedLog().Allow(&left_out)) {
      spdlog::warn(
          "page store: {} extents run degraded ({} members missing, {}): they are re-protected "
          "as soon as a daemon that is up, has room and holds none of their members is "
          "reachable{}",
          degraded, missing, options_.resilience.ToString(), Suppressed(left_out));
    }
    return;
  }
  MutexLock lock(&stats_mu_);
  if (degraded_since_ == Clock::time_point::max()) return;
  const auto now = Clock::now();
  auto ms = [&](Clock::time_point since) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
  };
  stats_.last_degraded_ms = ms(degraded_since_);
  stats_.last_reprotect_ms =
      reprotect_since_ == Clock::time_point::max() ? 0 : ms(reprotect_since_);
  stats_.last_reprotect_bytes = episode_bytes_;
  // Said however the members came back, rebuilt or used again as they were (a false down: their
  // daemon answered with the leases): whoever watches the log sees the end of every episode.
  spdlog::info(
      "page store: every extent is whole again: {} extents re-protected, {} written to new "
      "members in {} ms (degraded for {} ms); {} members in use again as they were",
      episode_extents_, FormatSize(episode_bytes_), stats_.last_reprotect_ms,
      stats_.last_degraded_ms, stats_.revalidated_members - episode_revalidated_from_);
  degraded_since_ = reprotect_since_ = Clock::time_point::max();
  episode_bytes_ = episode_extents_ = 0;
}

void PageStore::CheckCapacity() {
  const uint64_t group = static_cast<uint64_t>(options_.resilience.group_size());
  uint64_t unmapped = 0, missing = 0;
  for (const auto& e : extents_) {
    if (!e->mapped.load()) {
      ++unmapped;
    } else {
      missing += static_cast<uint64_t>(std::popcount(e->failed.load()));
    }
  }
  const uint64_t needed = unmapped * group + missing;
  const uint64_t free_slabs =
      CheckRunningCapacity(*cluster_, "page store", needed, slab_size_, [&] {
        return fmt::format("{} unmapped extents x {} slabs at {} plus {} members to re-protect",
                           unmapped, group, options_.resilience.ToString(), missing);
      });
  MutexLock lock(&stats_mu_);
  stats_.cluster_free_slabs = free_slabs;
  stats_.slabs_needed = needed;
}

Status PageStore::RebuildExtent(Worker& w, uint64_t index, bool wait) {
  const Clock::time_point started = Clock::now();
  Extent& e = *extents_[index];
  if (wait) {
    e.copy_mu.Lock();
  } else if (!e.copy_mu.TryLock()) {
    return Status::Ok();  // another copy of this extent runs and redoes what was written
  }
  MutexLock copy(&e.copy_mu, kAdoptLock);
  w.channels.DrainStragglers();  // the copy's synchronous ops need idle channels
  const Resilience& res = options_.resilience;
  uint32_t failed = 0;
  std::vector<client::Lease> members;
  bool can_produce = false;
  {
    ReaderLock lock(&e.mu);
    failed = e.failed.load();
    if (!e.mapped.load() || failed == 0) return Status::Ok();
    members = e.members;
    const uint32_t live = e.live_mask();
    can_produce = backup_ || (codec_ ? std::popcount(live) >= res.k : live != 0);
  }
  if (!can_produce) {
    // Nothing else holds the data. A member whose lease may still come back (its daemon was
    // declared down but may be the same process when it answers, or the failure was on the data
    // path of a daemon still up) is waited for: declaring its pages lost now would turn a false
    // down into data loss. Reads and writes of the extent fail (EIO) meanwhile; the cluster says
    // kLeasesReturned (Revalidate) or kLeasesLost (then this rebuild declares them lost).
    for (size_t j = 0; j < members.size(); ++j) {
      if (!((failed >> j) & 1) || IsVacant(members[j])) continue;
      if (cluster_->GetLeaseState(members[j]) != client::LeaseState::kGone) {
        return Unavailable(fmt::format(
            "extent {}: member {} on {} is unreachable but may come back; waiting for it", index, j,
            cluster_->node(members[j].node).endpoint.ToString()));
      }
    }
  }
  const size_t n = members.size();
  std::vector<client::NodeId> used;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) used.push_back(members[j].node);
  }
  Status result;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) continue;
    // Its daemon may have answered with the lease since the caller looked (a node-up starts a
    // pass while the cluster is still asking it; kLeasesReturned is on its way): a member that
    // missed nothing is used again as it is, decided here where the rebuild would start, never
    // copied to a fresh lease (on the same daemon, as like as not).
    if (!IsVacant(members[j])) {
      const LostLease self{members[j].node, members[j].id()};
      if (RevalidateExtent(e, {&self, 1}) > 0) {
        CountStat(&PageStoreStats::revalidated_members, 1);
        continue;
      }
    }
    if (!IsVacant(members[j]) &&
        cluster_->GetLeaseState(members[j]) == client::LeaseState::kRetained &&
        cluster_->node(members[j].node).alive) {
      // Its daemon answers again and the cluster is asking it for the lease right now: it comes
      // back (Revalidate, or a rebuild queued there if it missed writes) or is reported lost.
      result = Unavailable(fmt::format("extent {}: member {} may be back; checking", index, j));
      continue;
    }
    Result<client::Lease> fresh = cluster_->AllocateExcluding(used);
    if (!fresh) {
      // Retried when a daemon comes up and every reconcile_interval: say so once in a while.
      if (uint64_t left_out = 0; RebuildFailLog().Allow(&left_out)) {
        spdlog::warn(
            "page store: extent {} runs degraded ({} of {} members) until a daemon that holds "
            "none of its members can take a slab: {}{}",
            index, std::popcount(e.live_mask()), n, fresh.error().ToString(), Suppressed(left_out));
      }
      result = fresh.error();
      continue;
    }
    uint64_t written_bytes = 0;
    if (!can_produce) {
      // Nothing can bring the pages back: say which, and let new writes use the fresh lease.
      WriterLock ex(&e.mu);
      if (!StillMember(e, j, members[j]) || !((e.failed.load() >> j) & 1)) {
        (void)cluster_->Free({&*fresh, 1});
        continue;
      }
      uint64_t count = 0;
      for (uint64_t q = 0; q < e.pages; ++q) {
        if (e.Test(e.written, q)) {
          e.Set(e.lost, q, true);
          e.Set(e.written, q, false);
          ++count;
        }
      }
      CountStat(&PageStoreStats::lost_bytes, count * kPage);
      spdlog::error(
          "page store: {} pages of extent {} (export bytes {}..{}) are LOST: their "
          "daemon failed, resilience {} keeps no other copy and there is no backup "
          "file",
          count, index, index * extent_bytes_, index * extent_bytes_ + e.pages * kPage,
          res.ToString());
      e.members[j] = *fresh;
      e.failed.fetch_and(~(1u << j));
      e.stale.fetch_and(~(1u << j));
      e.leaving.fetch_and(~(1u << j));
    } else if (Status s = CopyMember(w, index, j, members[j], *fresh, &written_bytes); !s.ok()) {
      spdlog::warn("page store: rebuilding member {} of extent {} on {} abandoned: {}", j, index,
                   cluster_->node(fresh->node).endpoint.ToString(), s.ToString());
      CountStat(&PageStoreStats::copies_abandoned);
      (void)cluster_->Free({&*fresh, 1});
      result = s;
      continue;
    }
    const client::Lease& old = members[j];
    used.push_back(fresh->node);
    if (!IsVacant(old)) (void)cluster_->Free({&old, 1});
    NoteRebuilt(written_bytes, e.failed.load() == 0, started);
    spdlog::info("page store: extent {} member {} rebuilt on {} ({})", index, j,
                 cluster_->node(fresh->node).endpoint.ToString(), FormatSize(written_bytes));
  }
  // A rebuild on a request path: let the rebuild thread see whether the store is whole again.
  if (&w != &workers_.background() && e.failed.load() == 0) RequestReconcile();
  return result;
}

}  // namespace farmem::blockdev