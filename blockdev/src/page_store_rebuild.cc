// Failures, rebuild and re-protection: cluster events, the rebuild thread, rebuilding a member
// on another daemon, the degraded-episode bookkeeping and the capacity check.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "page_store.h"
#include "page_store_round.h"

namespace farmem::blockdev {

using namespace pagestore;

// ---------------------------------------------------------------------------------------------
// Failures and rebuild

void PageStore::OnClusterEvent(const client::Event& ev) {
  if (ev.type == client::EventType::kNodeUp) {
    // A daemon returned, restarted empty, or joined: it may take what degraded extents miss.
    RequestReconcile();
    return;
  }
  if (ev.lease_ids.empty()) return;
  if (ev.type != client::EventType::kNodeDown && ev.type != client::EventType::kLeasesLost &&
      ev.type != client::EventType::kEvictNotice) {
    return;
  }
  {
    MutexLock lock(&rebuild_mu_);
    for (uint64_t id : ev.lease_ids) lost_leases_.push_back({ev.node, id});
  }
  rebuild_cv_.SignalAll();
}

void PageStore::MarkLost(std::span<const LostLease> lost) {
  for (uint64_t index = 0; index < extents_.size(); ++index) {
    Extent& e = *extents_[index];
    ReaderLock lock(&e.mu);
    if (!e.mapped.load()) continue;
    uint32_t bits = 0;
    for (size_t j = 0; j < e.members.size(); ++j) {
      const client::Lease& m = e.members[j];
      // Lease ids are the daemon's: match the node too.
      if (std::any_of(lost.begin(), lost.end(),
                      [&](const LostLease& l) { return l.node == m.node && l.id == m.id(); })) {
        bits |= 1u << j;
      }
    }
    if (bits != 0) {
      e.failed.fetch_or(bits);
      NoteDegraded();
      MutexLock q(&rebuild_mu_);
      rebuild_queue_.push_back(index);
    }
  }
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
    return stopping_ || (rebuild_queue_.empty() && lost_leases_.empty() && !reconcile_requested_ &&
                         !rebuilding_);
  });
}

void PageStore::RebuildLoop() {
  Worker& w = *all_workers_.back();
  MutexLock lock(&rebuild_mu_);
  Clock::time_point next_reconcile = Clock::now() + options_.reconcile_interval;
  for (;;) {
    rebuild_cv_.WaitUntil(&rebuild_mu_, next_reconcile, [&] {
      rebuild_mu_.AssertHeld();
      return stopping_ || !rebuild_queue_.empty() || !lost_leases_.empty() || reconcile_requested_;
    });
    if (stopping_) return;
    const bool periodic = Clock::now() >= next_reconcile;
    const bool all = periodic || reconcile_requested_;
    reconcile_requested_ = false;
    rebuilding_ = true;
    std::vector<LostLease> lost;
    lost.swap(lost_leases_);
    lock.Unlock();
    if (!lost.empty()) MarkLost(lost);
    lock.Lock();
    std::vector<uint64_t> todo(rebuild_queue_.begin(), rebuild_queue_.end());
    rebuild_queue_.clear();
    lock.Unlock();
    Reprotect(w, std::move(todo), all);
    if (periodic) {
      CheckCapacity();
      next_reconcile = Clock::now() + options_.reconcile_interval;
    }
    lock.Lock();
    rebuilding_ = false;
    rebuild_cv_.SignalAll();
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
  if (degraded_since_ == Clock::time_point::max()) degraded_since_ = Clock::now();
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
  if (episode_extents_ > 0) {
    spdlog::info(
        "page store: every extent is whole again: {} extents re-protected, {} written to new "
        "members in {} ms (degraded for {} ms)",
        episode_extents_, FormatSize(episode_bytes_), stats_.last_reprotect_ms,
        stats_.last_degraded_ms);
  }
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
  uint64_t free_slabs = 0;
  size_t live = 0;
  if (needed > 0) {
    for (const client::NodeInfo& n : cluster_->nodes()) {
      if (!n.alive) continue;
      if (auto st = cluster_->Stat(n.id)) {
        free_slabs += wire::FreeForClient(*st);  // what this client may take (its share)
        ++live;
      }
    }
  }
  {
    MutexLock lock(&stats_mu_);
    stats_.cluster_free_slabs = free_slabs;
    stats_.slabs_needed = needed;
  }
  if (needed == 0 || free_slabs >= needed) return;
  if (uint64_t left_out = 0; CapacityLog().Allow(&left_out)) {
    spdlog::warn(
        "page store: the cluster is short of room for this export: {} live daemons have {} free "
        "slabs ({}), but it still needs {} ({}): {} unmapped extents x {} slabs at {} plus {} "
        "members to re-protect. Writes to unmapped space fail with ENOSPC once the room is gone: "
        "add daemons, free memory on them, or trim/discard unused space{}",
        live, free_slabs, FormatSize(free_slabs * slab_size_), needed,
        FormatSize(needed * slab_size_), unmapped, group, options_.resilience.ToString(), missing,
        Suppressed(left_out));
  }
}

Status PageStore::ReadMembers(Worker& w, Extent& e, std::span<const int> which, uint64_t offset,
                              uint8_t* base, size_t len) {
  Status first;
  std::vector<transport::Channel*> posted;  // the rebuild path may allocate
  for (int m : which) {
    const client::Lease& lease = e.members[static_cast<size_t>(m)];
    Status cs;
    transport::Channel* ch = w.channels.Get(lease.node, &cs);
    if (ch == nullptr) {
      first = cs;
      break;
    }
    const transport::Op op{transport::OpType::kRead,
                           lease.slab(),
                           offset,
                           base + static_cast<size_t>(m) * len,
                           static_cast<uint32_t>(len),
                           nullptr,
                           static_cast<uint64_t>(m)};
    if (Status ps = ch->Post(op); !ps.ok()) {
      first = ps;
      break;
    }
    (void)ch->Flush();  // a failure completes the op with an error below
    posted.push_back(ch);
  }
  const Deadline deadline = DeadlineIn(options_.op_timeout);
  transport::Completion c[8];
  for (transport::Channel* ch : posted) {
    while (ch->outstanding() > 0) {
      auto got = ch->Poll(c, options_.op_timeout);
      if (!got) {
        if (first.ok()) first = got.error();
        break;
      }
      for (size_t i = 0; i < *got; ++i) {
        if (!c[i].status.ok() && first.ok()) first = c[i].status;
      }
      if (*got == 0 && Clock::now() >= deadline) {
        if (first.ok()) first = DeadlineExceeded("a surviving member did not answer in time");
        break;
      }
    }
  }
  if (!first.ok()) w.channels.ResetStuck();  // nothing may land in `base` after we return
  return first;
}

Status PageStore::RebuildExtent(Worker& w, uint64_t index) {
  const Clock::time_point started = Clock::now();
  w.channels.DrainStragglers();  // the synchronous reads below need idle channels
  Extent& e = *extents_[index];
  WriterLock ex(&e.mu);
  const uint32_t failed = e.failed.load();
  if (!e.mapped.load() || failed == 0) return Status::Ok();
  const Resilience& res = options_.resilience;
  const size_t n = e.members.size();
  std::vector<client::NodeId> used;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) used.push_back(e.members[j].node);
  }
  const uint32_t live = e.live_mask();
  const bool can_read = codec_ ? std::popcount(live) >= res.k : live != 0;
  Status result;
  for (size_t j = 0; j < n; ++j) {
    if (!((failed >> j) & 1)) continue;
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
    // Rebuild member j's contents for every written page, a run of pages at a time.
    Status s;
    const uint64_t run_pages = std::max<uint64_t>(1, kMaxPiece / kPage / 4);
    std::vector<uint8_t> frag_buf;  // rebuild path: allocating here is fine (not a request path)
    for (uint64_t p = 0; p < e.pages && s.ok(); p += run_pages) {
      const uint64_t np = std::min(run_pages, e.pages - p);
      bool any = false;
      for (uint64_t q = p; q < p + np; ++q) any = any || e.Test(e.written, q);
      if (!any) continue;
      const uint64_t member_off = p * frag_size_;
      const size_t flen = static_cast<size_t>(np) * frag_size_;
      frag_buf.assign(flen * n, 0);
      if (!can_read) {
        if (!backup_) {
          s = DataLoss("no surviving copy and no backup file");
          break;
        }
        // none (or every copy gone): the backup file has the export bytes.
        std::vector<uint8_t> pagebuf(np * kPage);
        s = backup_->Read(index * extent_bytes_ + p * kPage, pagebuf);
        if (!s.ok()) break;
        if (codec_) {
          // Re-encode the pages into fragment j.
          for (uint64_t pg = 0; pg < np; ++pg) {
            for (int d = 0; d < res.k; ++d) {
              std::memcpy(frag_buf.data() + static_cast<size_t>(d) * flen + pg * frag_size_,
                          pagebuf.data() + pg * kPage + static_cast<uint64_t>(d) * frag_size_,
                          frag_size_);
            }
          }
          const uint8_t* data[kMaxMembers];
          uint8_t* parity[kMaxMembers];
          for (int d = 0; d < res.k; ++d) data[d] = frag_buf.data() + static_cast<size_t>(d) * flen;
          for (int d = 0; d < res.r; ++d) {
            parity[d] = frag_buf.data() + static_cast<size_t>(res.k + d) * flen;
          }
          s = codec_->Encode({data, static_cast<size_t>(res.k)},
                             {parity, static_cast<size_t>(res.r)}, flen);
        } else {
          std::memcpy(frag_buf.data() + j * flen, pagebuf.data(), flen);
        }
      } else if (codec_) {
        std::vector<int> present;
        for (size_t m = 0; m < n && static_cast<int>(present.size()) < res.k; ++m) {
          if (!((live >> m) & 1)) continue;
          present.push_back(static_cast<int>(m));
        }
        s = ReadMembers(w, e, present, member_off, frag_buf.data(), flen);
        if (!s.ok()) break;
        uint8_t* frags[kMaxMembers];
        for (size_t m = 0; m < n; ++m) frags[m] = frag_buf.data() + m * flen;
        const int erased[1] = {static_cast<int>(j)};
        // Decode reads the first k fragments that are not erased: make sure those are the ones
        // we read by erasing, for the decoder, every member we did not read.
        std::vector<int> not_read;
        for (size_t m = 0; m < n; ++m) {
          if (std::find(present.begin(), present.end(), static_cast<int>(m)) == present.end()) {
            not_read.push_back(static_cast<int>(m));
          }
        }
        (void)erased;
        if (static_cast<int>(not_read.size()) > res.r) {
          s = DataLoss("fewer than k members survive");
          break;
        }
        s = codec_->Decode({frags, n}, not_read, flen);
      } else {
        // A surviving replica has the bytes.
        for (size_t m = 0; m < n; ++m) {
          if (!((live >> m) & 1)) continue;
          Status cs;
          transport::Channel* ch = w.channels.Get(e.members[m].node, &cs);
          s = ch == nullptr
                  ? cs
                  : ch->Read(e.members[m].slab(), member_off, {frag_buf.data() + j * flen, flen});
          if (s.ok()) break;
        }
      }
      if (!s.ok()) break;
      Status cs;
      transport::Channel* ch = w.channels.Get(fresh->node, &cs);
      s = ch == nullptr ? cs
                        : ch->Write(fresh->slab(), member_off, {frag_buf.data() + j * flen, flen});
      if (s.ok()) written_bytes += flen;
    }
    if (!s.ok()) {
      if (!can_read && !backup_) {
        // Nothing can bring the pages back: say which, and let new writes use the fresh lease.
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
      } else {
        spdlog::warn("page store: rebuilding member {} of extent {} failed: {}", j, index,
                     s.ToString());
        (void)cluster_->Free({&*fresh, 1});
        result = s;
        continue;
      }
    }
    const client::Lease old = e.members[j];
    e.members[j] = *fresh;
    e.failed.fetch_and(~(1u << j));
    used.push_back(fresh->node);
    if (!IsVacant(old)) (void)cluster_->Free({&old, 1});
    NoteRebuilt(written_bytes, e.failed.load() == 0, started);
    spdlog::info("page store: extent {} member {} rebuilt on {} ({})", index, j,
                 cluster_->node(fresh->node).endpoint.ToString(), FormatSize(written_bytes));
  }
  // A rebuild on a request path: let the rebuild thread see whether the store is whole again.
  if (&w != all_workers_.back().get() && e.failed.load() == 0) RequestReconcile();
  return result;
}

}  // namespace farmem::blockdev
