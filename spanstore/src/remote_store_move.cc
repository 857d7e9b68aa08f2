// RemoteStore: moving the members a daemon asked back (EVICT_NOTICE: host memory pressure, or a
// drain). A noticed member is "leaving", not failed: its daemon still serves it until the
// notice's deadline. The recovery thread copies its rows to a new slab on another daemon with
// room (never the noticing one, nor one that says it is draining or short of memory), swaps the
// member in the group and frees the old lease — the acknowledgement the daemon waits for. This
// works in every resilience mode, none included: nothing is rebuilt, the bytes are copied.
//
// While a member is copied the group is `rebuilding` (as for re-protection): no new rows are
// placed in it, and a set reserved before and committed after sees the flag or the new epoch and
// is written elsewhere, so nothing written during the move is lost. Rows are immutable once
// written (a row only becomes holes and is freed), so a copied row stays right.
//
// Moves run earliest deadline first, before any re-protection. When no daemon has room: with
// redundancy to spare the member is given up at once (degraded; its lease goes back, so the lender
// gets its memory now) and re-protected when a daemon has room; without, the move is retried
// until the deadline, after which the member is lost as any other (reads of what only lived there
// give DataLoss). Every such case says so in the log.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>

#include "farmem/spanstore/remote_store.h"

namespace farmem::spanstore {

namespace {

// How soon a move that found no daemon with room is tried again (node-up events and reconcile
// ticks retry it at once too).
constexpr std::chrono::milliseconds kMoveRetry{100};

int64_t MillisBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

}  // namespace

void RemoteStore::OnEvictNotice(const client::Event& ev) {
  const Clock::time_point now = Clock::now();
  const Clock::time_point deadline = ev.deadline != Clock::time_point{}
                                         ? ev.deadline
                                         : now + std::chrono::milliseconds(ev.grace_ms);
  size_t queued = 0;
  {
    MutexLock lock(&mu_);
    for (uint64_t id : ev.lease_ids) {
      auto member = MemberOfLocked(id, ev.node);
      if (!member) continue;
      auto [g, m] = *member;
      const uint32_t bit = 1u << m;
      // Re-protection must not place the member back on a daemon that wants its memory.
      g->evicted_mask |= bit;
      if (((g->failed_mask | g->lost_mask) & bit) != 0) continue;  // re-protection has it
      auto pending = std::find_if(moves_.begin(), moves_.end(),
                                  [id](const PendingMove& p) { return p.lease == id; });
      if (pending != moves_.end()) {  // noticed again (drain after pressure): the sooner counts
        pending->deadline = std::min(pending->deadline, deadline);
        continue;
      }
      g->leaving_mask |= bit;
      moves_.push_back({g, m, id, now, deadline, now, false});
      ++queued;
    }
    if (queued > 0) {
      spdlog::info(
          "far memory: {} wants {} slab(s) back within {} ms (eviction notice): moving the span "
          "sets there to other daemons",
          ev.endpoint.ToString(), queued, std::max<int64_t>(0, MillisBetween(now, deadline)));
    }
  }
  if (queued > 0) recovery_cv_.SignalAll();
}

std::optional<RemoteStore::PendingMove> RemoteStore::TakeDueMoveLocked(Clock::time_point now) {
  auto best = moves_.end();
  for (auto it = moves_.begin(); it != moves_.end(); ++it) {
    if (it->next_try > now) continue;
    if (best == moves_.end() || it->deadline < best->deadline) best = it;
  }
  if (best == moves_.end()) return std::nullopt;
  PendingMove mv = *best;
  moves_.erase(best);
  return mv;
}

Clock::time_point RemoteStore::NextMoveTryLocked() const {
  Clock::time_point next = Clock::time_point::max();
  for (const PendingMove& mv : moves_) next = std::min(next, mv.next_try);
  return next;
}

void RemoteStore::ForgetMovesLocked(const Group* g) {
  std::erase_if(moves_, [g](const PendingMove& mv) { return mv.group == g; });
}

std::vector<client::NodeId> RemoteStore::MoveExclusions(const std::vector<client::Lease>& members,
                                                        uint32_t live, client::NodeId from) const {
  std::vector<client::NodeId> out;
  for (size_t m = 0; m < members.size(); ++m) {
    if (((live >> m) & 1) != 0 && !Vacant(members[m])) out.push_back(members[m].node);
  }
  out.push_back(from);
  for (const client::NodeInfo& info : cluster_->nodes()) {
    if (info.stat && (info.stat->features & (wire::kStateDraining | wire::kStateUnderPressure))) {
      out.push_back(info.id);
    }
  }
  return out;
}

void RemoteStore::Move(IoContext& io, PendingMove mv) {
  Group* g = mv.group;
  const int j = mv.member;
  const int n = res_.group_size();
  const uint32_t bit = 1u << j;
  std::vector<client::Lease> members;
  uint32_t live = 0;
  size_t used_rows = 0;
  {
    MutexLock lock(&mu_);
    auto it = by_lease_.find(mv.lease);
    if (it == by_lease_.end() || it->second.first != g || it->second.second != j ||
        ((g->failed_mask | g->lost_mask) & bit) != 0) {
      // Failed meanwhile (re-protection has it now) or gone with its group.
      if (it != by_lease_.end() && it->second.first == g) g->leaving_mask &= ~bit;
      return;
    }
    members = g->members;
    const uint32_t all = n >= 32 ? ~0u : ((1u << n) - 1);
    live = all & ~g->failed_mask & ~g->lost_mask;
    used_rows = g->used_rows;
  }
  const client::Lease from = members[static_cast<size_t>(j)];
  const std::string from_name = MemberName(from);
  Clock::time_point now = Clock::now();
  if (now >= mv.deadline) {
    MarkFailed(g, j, mv.lease,
               Expired(fmt::format("the eviction notice from {} ran out before the member could "
                                   "be moved",
                                   from_name)));
    return;
  }
  auto requeue = [&](Clock::time_point next_try) {
    mv.next_try = next_try;
    MutexLock lock(&mu_);
    moves_.push_back(mv);
  };

  // Where to: a daemon with room that is neither in the group nor asking for memory itself.
  std::vector<client::NodeId> avoid = MoveExclusions(members, live, from.node);
  Result<client::Lease> fresh = Err(Internal("no placement tried"));
  for (int attempt = 0; attempt < 3; ++attempt) {
    fresh = cluster_->AllocateExcluding(avoid);
    if (!fresh) break;
    // Placement just STATed the daemon it chose: one that is short of memory or draining would
    // only notice this slab again.
    const client::NodeInfo info = cluster_->node(fresh->node);
    if (!info.stat ||
        (info.stat->features & (wire::kStateDraining | wire::kStateUnderPressure)) == 0) {
      break;
    }
    (void)cluster_->Free({&*fresh, 1});
    avoid.push_back(fresh->node);
    fresh = Err(ResourceExhausted(
        fmt::format("{} is short of memory or draining", info.endpoint.ToString())));
  }
  if (!fresh) {
    const uint32_t rest = live & ~bit;
    const bool spare = res_.mode == client::Resilience::Mode::kErasure
                           ? res_.r > 0 && std::popcount(rest) >= res_.k
                           : (res_.mode == client::Resilience::Mode::kReplicate && rest != 0);
    if (spare) {
      spdlog::warn(
          "far memory: no daemon can take slab group {} member {} ({} span sets) that {} wants "
          "back ({}); giving it up now: the group runs degraded ({}) until a daemon has room",
          g->id, j, used_rows, from_name, fresh.error().ToString(), res_.ToString());
      MarkFailed(
          g, j, mv.lease,
          ResourceExhausted(fmt::format("{} wants it back and no daemon can take it", from_name)));
      (void)cluster_->Free({&from, 1});  // the lender gets its memory back now
      return;
    }
    if (!mv.no_room_logged) {
      mv.no_room_logged = true;
      spdlog::error(
          "far memory: no daemon can take slab group {} member {} ({} span sets) that {} wants "
          "back ({}); resilience {} keeps no other copy: retrying until the deadline in {} ms, "
          "after which the objects only there are LOST",
          g->id, j, used_rows, from_name, fresh.error().ToString(), res_.ToString(),
          MillisBetween(now, mv.deadline));
    }
    requeue(now + kMoveRetry);
    return;
  }

  // Copy every written row, kMaxSetWidth rows per round trip.
  const size_t span = span_size_;
  constexpr size_t kBatch = static_cast<size_t>(kMaxSetWidth);
  if (move_buffer_.size() < span * kBatch) move_buffer_.resize(span * kBatch);
  const Clock::time_point copy_start = Clock::now();
  std::vector<uint32_t> rows;
  {
    MutexLock lock(&mu_);
    rows = StartRebuildLocked(g);
  }
  // Runs one batch of reads from `from` or writes to `fresh`; a stale channel is reopened once.
  auto run = [&](transport::OpType type, const client::Lease& lease, size_t first,
                 size_t count) -> Status {
    for (int attempt = 0; attempt < 2; ++attempt) {
      transport::Op ops[kBatch];
      client::NodeId nodes[kBatch];
      Status results[kBatch];
      for (size_t b = 0; b < count; ++b) {
        ops[b] = {type,
                  lease.slab(),
                  static_cast<uint64_t>(rows[first + b]) * span,
                  move_buffer_.data() + b * span,
                  static_cast<uint32_t>(span),
                  nullptr,
                  0};
        nodes[b] = lease.node;
      }
      RunOps(io, {ops, count}, {nodes, count}, {results, count});
      Status s;
      for (size_t b = 0; b < count && s.ok(); ++b) s = results[b];
      if (s.ok() || attempt > 0 || !StaleChannel(io, lease.node)) return s;
    }
    return Status::Ok();
  };
  Status read_error;
  Status write_error;
  for (size_t i = 0; i < rows.size(); i += kBatch) {
    const size_t count = std::min(kBatch, rows.size() - i);
    if (Clock::now() >= mv.deadline) {
      read_error = Expired(fmt::format("the eviction notice from {} ran out after {} of {} rows",
                                       from_name, i, rows.size()));
      break;
    }
    read_error = run(transport::OpType::kRead, from, i, count);
    if (!read_error.ok()) break;
    write_error = run(transport::OpType::kWrite, *fresh, i, count);
    if (!write_error.ok()) break;
  }
  now = Clock::now();
  if (!read_error.ok() || !write_error.ok()) {
    {
      MutexLock lock(&mu_);
      g->rebuilding = false;
      ++copies_abandoned_;
    }
    (void)cluster_->Free({&*fresh, 1});
    if (!write_error.ok()) {
      // The new daemon's fault: try again (placement now puts that daemon last).
      spdlog::warn("far memory: moving slab group {} member {} to {} failed: {}; trying again",
                   g->id, j, MemberName(*fresh), write_error.ToString());
      cluster_->ReportFailure(fresh->node, write_error);
      requeue(now);
      return;
    }
    // The leaving member cannot be read any more: it is lost as a failed member would be.
    spdlog::warn("far memory: moving slab group {} member {} off {} failed: {}", g->id, j,
                 from_name, read_error.ToString());
    if (read_error.code() != StatusCode::kExpired) cluster_->ReportFailure(from.node, read_error);
    if (NodeGone(read_error)) {
      MarkFailed(g, j, mv.lease, read_error);
    } else {
      requeue(now + kMoveRetry);
    }
    return;
  }

  // Swap the copy in. Even if the member was declared failed meanwhile (its notice ran out as the
  // last rows were read), every row was read whole: the copy is complete. Not so if a cell of it
  // failed authentication meanwhile (ReportCorrupt marks it stale as well as failed: its bytes
  // cannot be trusted): the copy may hold that cell, read before or after the read that found it,
  // and swapping it in would clear the marks, leaving a bad cell in a member taken for good (one
  // more failure in the group and that cell is lost). Then the copy is dropped and re-protection
  // rebuilds the member from the others, never back onto the daemon that noticed it.
  const uint64_t daemon_id = cluster_->node(fresh->node).daemon_id;
  bool swapped = false;
  bool corrupt = false;
  uint64_t moved_ms = 0;
  int64_t slack_ms = MillisBetween(now, mv.deadline);
  {
    MutexLock lock(&mu_);
    g->rebuilding = false;
    auto it = by_lease_.find(mv.lease);
    const bool same = it != by_lease_.end() && it->second.first == g && it->second.second == j;
    corrupt = same && (g->stale_mask & bit) != 0;
    if (same && (g->lost_mask & bit) == 0 && !corrupt) {
      InstallMemberLocked(g, j, *fresh, daemon_id);
      ++moved_;
      moved_ms = static_cast<uint64_t>(std::max<int64_t>(0, MillisBetween(mv.noticed, now)));
      move_last_ms_ = moved_ms;
      moved_bytes_ += rows.size() * uint64_t{span};
      move_last_bytes_ = rows.size() * uint64_t{span};
      move_max_ms_ = std::max(move_max_ms_, moved_ms);
      const uint64_t slack = static_cast<uint64_t>(std::max<int64_t>(0, slack_ms));
      move_min_slack_ms_ = moved_ == 1 ? slack : std::min(move_min_slack_ms_, slack);
      swapped = true;
    } else {
      ++copies_abandoned_;  // the member changed under the copy (given up, lost or corrupt)
      if (same) g->leaving_mask &= ~bit;  // re-protection has it now (or it is given up)
    }
  }
  if (!swapped) {
    (void)cluster_->Free({&*fresh, 1});
    if (corrupt) {
      spdlog::warn(
          "far memory: slab group {} member {} failed authentication while it was moved off {}: "
          "the copy is dropped and the member rebuilt from the other members",
          g->id, j, from_name);
      recovery_cv_.SignalAll();
    }
    return;
  }
  (void)cluster_->Free({&from, 1});  // the acknowledgement: the daemon may take it back now
  spdlog::info(
      "far memory: slab group {} member {} moved from {} to {} ({} span sets copied in {} ms; "
      "{} ms after the notice, {} ms before its deadline)",
      g->id, j, from_name, MemberName(*fresh), rows.size(), MillisBetween(copy_start, now),
      moved_ms, slack_ms);
}

}  // namespace farmem::spanstore
