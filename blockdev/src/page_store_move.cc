// Member copies and eviction moves: the copy routine shared by rebuild and moves (ReadMembers,
// ProduceMember, CopyPages, CopyMember) and the moves of members whose daemon sent an eviction
// notice (MarkLeaving, MoveLeaving, MoveMember). Rebuild itself is page_store_rebuild.cc.
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
// Eviction notices

namespace {
LogEvery& NoRoomLog() {
  static LogEvery log(std::chrono::seconds(5));
  return log;
}
int64_t MsUntil(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
}
}  // namespace

void PageStore::MarkLeaving(std::span<const NoticedLease> noticed) {
  for (uint64_t index = 0; index < extents_.size(); ++index) {
    Extent& e = *extents_[index];
    ReaderLock lock(&e.mu);
    if (!e.mapped.load()) continue;
    for (size_t j = 0; j < e.members.size(); ++j) {
      const client::Lease& m = e.members[j];
      // Lease ids are the daemon's: match the node too.
      auto it = std::find_if(noticed.begin(), noticed.end(), [&](const NoticedLease& l) {
        return l.node == m.node && l.id == m.id();
      });
      if (it == noticed.end()) continue;
      e.leaving.fetch_or(1u << j);
      moves_.push_back({index, j, m, it->deadline, it->noticed});
    }
  }
}

std::vector<client::NodeId> PageStore::NodesNotTaking() const {
  std::vector<client::NodeId> out;
  for (const client::NodeInfo& n : cluster_->nodes()) {
    if (n.stat && (n.stat->features & (wire::kStateDraining | wire::kStateUnderPressure)) != 0) {
      out.push_back(n.id);
    }
  }
  return out;
}

bool PageStore::MoveLeaving(Worker& w) {
  if (moves_.empty()) return false;
  std::stable_sort(moves_.begin(), moves_.end(),
                   [](const Move& a, const Move& b) { return a.deadline < b.deadline; });
  std::vector<Move> left;
  std::vector<uint64_t> no_room_extents;
  std::vector<uint64_t> missed;
  Status no_room_why;
  for (size_t i = 0; i < moves_.size(); ++i) {
    const Move& m = moves_[i];
    {
      MutexLock lock(&rebuild_mu_);
      if (stopping_) return false;
    }
    move_burst_since_ = std::min(move_burst_since_, m.noticed);
    if (Clock::now() >= m.deadline) {
      // Too late: the daemon ends the lease, the client core reports it lost, and it is
      // re-protected like any lost member.
      missed.push_back(m.index);
      continue;
    }
    if (!no_room_why.ok()) {  // no daemon had room a moment ago: try again on the next pass
      left.push_back(m);
      no_room_extents.push_back(m.index);
      continue;
    }
    const MoveOutcome o = MoveMember(w, m);
    switch (o.kind) {
      case MoveOutcome::Kind::kMoved:
        move_burst_bytes_ += o.bytes;
        break;
      case MoveOutcome::Kind::kLost:
        missed.push_back(m.index);
        break;
      case MoveOutcome::Kind::kNoRoom:
        left.push_back(m);
        no_room_extents.push_back(m.index);
        no_room_why = o.status;
        break;
      case MoveOutcome::Kind::kFailed:
        left.push_back(m);
        if (uint64_t left_out = 0; RebuildFailLog().Allow(&left_out)) {
          spdlog::warn(
              "page store: moving extent {} member {} off {} failed ({}); retried until its "
              "EVICT_NOTICE deadline in {} ms{}",
              m.index, m.member, cluster_->node(m.lease.node).endpoint.ToString(),
              o.status.ToString(), MsUntil(m.deadline), Suppressed(left_out));
        }
        break;
    }
  }
  if (!missed.empty()) {
    CountStat(&PageStoreStats::moves_missed, missed.size());
    std::string list;
    for (uint64_t index : missed) list += fmt::format("{}{}", list.empty() ? "" : ", ", index);
    spdlog::warn(
        "page store: members of extents [{}] were not moved before their EVICT_NOTICE deadline: "
        "they are handled as lost members",
        list);
  }
  if (!no_room_extents.empty()) {
    if (uint64_t left_out = 0; NoRoomLog().Allow(&left_out)) {
      std::string list;
      for (uint64_t index : no_room_extents) {
        list += fmt::format("{}{}", list.empty() ? "" : ", ", index);
      }
      const Resilience& res = options_.resilience;
      const char* outcome =
          backup_ ? "their pages are read from the backup file until daemons have room"
          : res.mode == Resilience::Mode::kNone
              ? "their pages are LOST (IoError) unless a daemon frees room before"
              : "they run degraded on their other members until daemons have room";
      spdlog::error(
          "page store: no daemon can take the members of extents [{}] that must leave by their "
          "EVICT_NOTICE deadline (the first in {} ms): {}; retrying until the deadline; after it, "
          "{} "
          "({}){}",
          list, MsUntil(left.front().deadline), no_room_why.ToString(), outcome, res.ToString(),
          Suppressed(left_out));
    }
  }
  moves_ = std::move(left);
  if (moves_.empty() && move_burst_since_ != Clock::time_point::max()) {
    MutexLock lock(&stats_mu_);
    stats_.last_move_ms = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - move_burst_since_)
            .count());
    stats_.last_move_bytes = move_burst_bytes_;
    if (move_burst_bytes_ > 0) {
      spdlog::info("page store: every member under EVICT_NOTICE is moved: {} in {} ms",
                   FormatSize(move_burst_bytes_), stats_.last_move_ms);
    }
    move_burst_since_ = Clock::time_point::max();
    move_burst_bytes_ = 0;
  }
  return !moves_.empty();
}

PageStore::MoveOutcome PageStore::MoveMember(Worker& w, const Move& m) {
  using Kind = MoveOutcome::Kind;
  Extent& e = *extents_[m.index];
  MutexLock copy(&e.copy_mu);
  w.channels.DrainStragglers();  // the copy's synchronous ops need idle channels
  // Never back onto the daemon that wants its memory, nor onto one that shares the group.
  std::vector<client::NodeId> exclude{m.lease.node};
  {
    ReaderLock lock(&e.mu);
    if (!StillMember(e, m.member, m.lease)) return {};  // trimmed or replaced meanwhile
    // Lost before it could be moved (the daemon ended the lease at its deadline, and the client
    // learnt it before this pass saw the deadline pass): a missed move, rebuilt from the others
    // like any lost member.
    if ((e.failed.load() >> m.member) & 1) return {.kind = Kind::kLost, .status = Status::Ok()};
    const uint32_t failed = e.failed.load();
    for (size_t j = 0; j < e.members.size(); ++j) {
      if (j != m.member && !((failed >> j) & 1)) exclude.push_back(e.members[j].node);
    }
  }
  std::vector<client::NodeId> also = NodesNotTaking();
  also.insert(also.end(), exclude.begin(), exclude.end());
  Result<client::Lease> fresh = cluster_->AllocateExcluding(also);
  // The STATs behind NodesNotTaking may be old (pressure over): ask the others too.
  if (!fresh) fresh = cluster_->AllocateExcluding(exclude);
  if (!fresh) return {.kind = Kind::kNoRoom, .status = fresh.error()};
  uint64_t bytes = 0;
  Status s = CopyMember(w, m.index, m.member, m.lease, *fresh, &bytes);
  if (!s.ok()) {
    CountStat(&PageStoreStats::copies_abandoned);
    (void)cluster_->Free({&*fresh, 1});
    return {.kind = Kind::kFailed, .status = s};
  }
  // FREE is the acknowledgement: the daemon gets the memory back at once.
  if (Status fs = cluster_->Free({&m.lease, 1}); !fs.ok()) {
    spdlog::warn("page store: freeing the moved lease: {}", fs.ToString());
  }
  {
    MutexLock lock(&stats_mu_);
    stats_.moved_members += 1;
    stats_.moved_bytes += bytes;
  }
  spdlog::info(
      "page store: extent {} member {} moved off {} to {} ({}, {} ms before the "
      "EVICT_NOTICE deadline)",
      m.index, m.member, cluster_->node(m.lease.node).endpoint.ToString(),
      cluster_->node(fresh->node).endpoint.ToString(), FormatSize(bytes), MsUntil(m.deadline));
  return {.kind = Kind::kMoved, .status = Status::Ok(), .bytes = bytes};
}

// ---------------------------------------------------------------------------------------------
// Member copies

Status PageStore::ReadMembers(Worker& w, Extent& e, std::span<const int> which, uint64_t offset,
                              uint8_t* base, size_t len) {
  std::vector<CopyOp> ops;  // the rebuild path may allocate
  for (int m : which) {
    const client::Lease& lease = e.members[static_cast<size_t>(m)];
    CopyOp o;
    o.node = lease.node;
    o.op = {transport::OpType::kRead,   lease.slab(), offset, base + static_cast<size_t>(m) * len,
            static_cast<uint32_t>(len), nullptr,      0};
    ops.push_back(o);
  }
  return RunCopyOps(*round_params_, cluster_, w, ops);
}

Status PageStore::ProduceMember(Worker& w, uint64_t index, Extent& e, size_t j, uint64_t first,
                                uint64_t npages, std::vector<uint8_t>& buf, uint8_t** out) {
  const Resilience& res = options_.resilience;
  const size_t n = e.members.size();
  const size_t flen = static_cast<size_t>(npages) * frag_size_;
  const uint64_t member_off = first * frag_size_;
  buf.resize(flen * n);
  const uint32_t live = e.live_mask();
  Status why;
  // The member itself while it is live (a leaving member): one read, no decoding.
  if ((live >> j) & 1) {
    const int self[1] = {static_cast<int>(j)};
    why = ReadMembers(w, e, self, member_off, buf.data(), flen);
    if (why.ok()) {
      *out = buf.data() + j * flen;
      return Status::Ok();
    }
  }
  const uint32_t others = live & ~(1u << j);
  if (codec_ && std::popcount(others) >= res.k) {
    std::vector<int> present;
    for (size_t m = 0; m < n && static_cast<int>(present.size()) < res.k; ++m) {
      if ((others >> m) & 1) present.push_back(static_cast<int>(m));
    }
    Status s = ReadMembers(w, e, present, member_off, buf.data(), flen);
    if (s.ok()) {
      uint8_t* frags[kMaxMembers];
      for (size_t m = 0; m < n; ++m) frags[m] = buf.data() + m * flen;
      // Decode reads the first k fragments that are not erased: erase, for the decoder, every
      // member we did not read (member j among them).
      std::vector<int> not_read;
      for (size_t m = 0; m < n; ++m) {
        if (std::find(present.begin(), present.end(), static_cast<int>(m)) == present.end()) {
          not_read.push_back(static_cast<int>(m));
        }
      }
      s = codec_->Decode({frags, n}, not_read, flen);
      if (s.ok()) {
        *out = buf.data() + j * flen;
        return Status::Ok();
      }
    }
    why = s;
  } else if (!codec_) {
    for (size_t m = 0; m < n; ++m) {  // a replica has the bytes
      if (!((others >> m) & 1)) continue;
      const int one[1] = {static_cast<int>(m)};
      why = ReadMembers(w, e, one, member_off, buf.data(), flen);
      if (why.ok()) {
        *out = buf.data() + m * flen;
        return Status::Ok();
      }
    }
  }
  if (backup_) {
    // The backup file has the export bytes (none, or too few members left).
    std::vector<uint8_t> pagebuf(npages * kPage);
    FARMEM_RETURN_IF_ERROR(backup_->Read(index * extent_bytes_ + first * kPage, pagebuf));
    if (codec_) {
      // Re-encode the pages into fragment j.
      for (uint64_t pg = 0; pg < npages; ++pg) {
        for (int d = 0; d < res.k; ++d) {
          std::memcpy(buf.data() + static_cast<size_t>(d) * flen + pg * frag_size_,
                      pagebuf.data() + pg * kPage + static_cast<uint64_t>(d) * frag_size_,
                      frag_size_);
        }
      }
      const uint8_t* data[kMaxMembers];
      uint8_t* parity[kMaxMembers];
      for (int d = 0; d < res.k; ++d) data[d] = buf.data() + static_cast<size_t>(d) * flen;
      for (int d = 0; d < res.r; ++d) {
        parity[d] = buf.data() + static_cast<size_t>(res.k + d) * flen;
      }
      FARMEM_RETURN_IF_ERROR(codec_->Encode({data, static_cast<size_t>(res.k)},
                                            {parity, static_cast<size_t>(res.r)}, flen));
    } else {
      std::memcpy(buf.data() + j * flen, pagebuf.data(), flen);
    }
    *out = buf.data() + j * flen;
    return Status::Ok();
  }
  return DataLoss(why.ok() ? std::string("no surviving copy and no backup file")
                           : fmt::format("no other copy can be read and there is no backup file "
                                         "(last error: {})",
                                         why.ToString()));
}

Status PageStore::CopyPages(Worker& w, uint64_t index, Extent& e, size_t j,
                            const client::Lease& fresh, std::span<const uint64_t> pages,
                            bool skip_unwritten, std::vector<uint8_t>& buf, uint64_t* bytes) {
  // Runs of consecutive pages, at most a quarter of a piece each (one op per member).
  const uint64_t max_run = std::max<uint64_t>(1, kMaxPiece / kPage / 4);
  size_t i = 0;
  while (i < pages.size()) {
    const uint64_t first = pages[i];
    uint64_t np = 1;
    while (i + np < pages.size() && np < max_run && pages[i + np] == first + np) ++np;
    i += static_cast<size_t>(np);
    if (skip_unwritten) {
      bool any = false;
      for (uint64_t q = first; q < first + np && !any; ++q) any = e.Test(e.written, q);
      if (!any) continue;
    }
    uint8_t* src = nullptr;
    FARMEM_RETURN_IF_ERROR(ProduceMember(w, index, e, j, first, np, buf, &src));
    CopyOp op;
    op.node = fresh.node;
    const uint32_t flen = static_cast<uint32_t>(np * frag_size_);
    op.op = {transport::OpType::kWrite, fresh.slab(), first * frag_size_, src, flen, nullptr, 0};
    FARMEM_RETURN_IF_ERROR(RunCopyOps(*round_params_, cluster_, w, {&op, 1}));
    *bytes += flen;
  }
  return Status::Ok();
}

Status PageStore::CopyMember(Worker& w, uint64_t index, size_t j, const client::Lease& old,
                             const client::Lease& fresh, uint64_t* bytes) {
  Extent& e = *extents_[index];
  auto changed = [&] {
    return Aborted(fmt::format("extent {} member {} changed while it was copied", index, j));
  };
  // Live when the copy starts (a move): its own bytes are copied while it stays live.
  bool was_live = false;
  {
    // From here on every write round marks the pages it writes (MarkDirty): exclusively, so that
    // no write that started before is still in flight unmarked.
    WriterLock ex(&e.mu);
    if (!StillMember(e, j, old)) return changed();
    was_live = !((e.failed.load() >> j) & 1);
    for (size_t i = 0; i < e.words(); ++i) e.dirty[i].store(0, std::memory_order_relaxed);
    e.tracking.store(true, std::memory_order_release);
  }
  struct TrackingOff {
    Extent& e;
    ~TrackingOff() { e.tracking.store(false, std::memory_order_release); }
  } tracking_off{e};
  std::vector<uint8_t> buf;  // the rebuild path may allocate
  auto stopping = [&] {
    MutexLock lock(&rebuild_mu_);
    return stopping_;
  };
  // 1. Every page that holds data, a run at a time, with the extent shared: I/O goes on.
  std::vector<uint64_t> pages;
  const uint64_t max_run = std::max<uint64_t>(1, kMaxPiece / kPage / 4);
  for (uint64_t p = 0; p < e.pages; p += max_run) {
    if (stopping()) return Aborted("the page store is shutting down");
    ReaderLock lock(&e.mu);
    if (!StillMember(e, j, old)) return changed();
    pages.clear();
    for (uint64_t q = p; q < std::min(e.pages, p + max_run); ++q) pages.push_back(q);
    FARMEM_RETURN_IF_ERROR(CopyPages(w, index, e, j, fresh, pages, true, buf, bytes));
  }
  // 2. What was written meanwhile, again shared while there is much of it; the last few pages
  // exclusively, and then the swap.
  constexpr size_t kSwapPages = 64;
  constexpr int kMaxPasses = 4;
  auto take_dirty = [&] {
    pages.clear();
    for (uint64_t q = 0; q < e.pages; ++q) {
      if (e.Test(e.dirty, q)) pages.push_back(q);
    }
    for (size_t i = 0; i < e.words(); ++i) e.dirty[i].store(0, std::memory_order_relaxed);
  };
  for (int pass = 0;; ++pass) {
    {
      WriterLock ex(&e.mu);  // no write in flight: the dirty set is complete
      if (!StillMember(e, j, old)) return changed();
      take_dirty();
      // Marked stale meanwhile (a page of it failed authentication, or a write went past it):
      // pages copied from it before then may carry its bad bytes, and the swap would clear the
      // marks, leaving them in a member taken for good. The copy is dropped; the member, failed
      // now, is rebuilt from the others.
      if (was_live && ((e.stale.load() >> j) & 1)) {
        return Aborted(fmt::format(
            "extent {} member {} failed authentication (or missed a write) while it was copied: "
            "it is rebuilt from the other members instead",
            index, j));
      }
      if (pages.size() <= kSwapPages || pass + 1 >= kMaxPasses) {
        FARMEM_RETURN_IF_ERROR(CopyPages(w, index, e, j, fresh, pages, false, buf, bytes));
        e.members[j] = fresh;
        e.failed.fetch_and(~(1u << j));
        e.stale.fetch_and(~(1u << j));
        e.leaving.fetch_and(~(1u << j));
        return Status::Ok();
      }
    }
    if (stopping()) return Aborted("the page store is shutting down");
    ReaderLock lock(&e.mu);
    if (!StillMember(e, j, old)) return changed();
    FARMEM_RETURN_IF_ERROR(CopyPages(w, index, e, j, fresh, pages, false, buf, bytes));
  }
}

}  // namespace farmem::blockdev
