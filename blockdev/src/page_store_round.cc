// The I/O round (page_store_round.h) and RunPieces, which cuts a batch's pieces into rounds and
// handles their outcomes (retries, rebuilds before acknowledging, the backup file).
#include "page_store_round.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "page_store.h"

namespace farmem::blockdev::pagestore {

// ---------------------------------------------------------------------------------------------
// Round

Status FinishRead(const RoundParams& params, Worker& w, size_t index, Piece& p, bool* decoded) {
  *decoded = false;
  if (p.finished) return Status::Ok();
  if (params.codec != nullptr) {
    const int k = params.resilience.k;
    const size_t flen = static_cast<size_t>(p.npages) * params.frag_size;
    const uint32_t data_mask = (1u << k) - 1;
    uint8_t* frags[kMaxMembers];
    for (size_t j = 0; j < p.extent->members.size(); ++j) frags[j] = p.stage + j * flen;
    // Decode when a data fragment is not among the first k to arrive.
    uint32_t first_k = 0;
    for (int t = 0; t < k; ++t) first_k |= 1u << p.order[t];
    if ((first_k & data_mask) != data_mask) {
      int present[kMaxMembers];
      for (int t = 0; t < k; ++t) present[t] = p.order[t];
      FARMEM_RETURN_IF_ERROR(params.codec->ReconstructData(
          {frags, p.extent->members.size()}, {present, static_cast<size_t>(k)}, flen));
      *decoded = true;
    }
    for (uint64_t pg = 0; pg < p.npages; ++pg) {
      for (int j = 0; j < k; ++j) {
        std::memcpy(p.buf + pg * kPage + static_cast<uint64_t>(j) * params.frag_size,
                    frags[j] + pg * params.frag_size, params.frag_size);
      }
    }
  }
  p.finished = true;
  for (uint64_t pg = 0; pg < p.npages; ++pg) {
    const uint64_t page = p.first_page + pg;
    if (!p.extent->Test(p.extent->written, page)) {
      std::memset(p.buf + pg * kPage, 0, kPage);
    } else if (params.crypto != nullptr &&
               !params.crypto
                    ->Open(*w.cipher, p.index * params.extent_pages + page, p.buf + pg * kPage)
                    .ok()) {
      ++p.bad;
      w.bad_pages.push_back({index, page});
    }
  }
  return Status::Ok();
}

Round::Round(const RoundParams& params, client::Cluster* cluster, Worker* w,
             std::span<Status> op_status, Early* early)
    : params_(params),
      cluster_(cluster),
      w_(w),
      op_status_(op_status),
      early_(early),
      pieces_(w->round_pieces.data()),
      ops_(w->round_ops),
      per_node_(w->per_node) {
  ops_.clear();
  per_node_.clear();
  w->bad_pages.clear();
}

bool Round::Fits(const Piece& p) const {
  if (count_ == kMaxRoundPieces) return false;
  if (params_.codec && stage_used_ + StageBytes(p) > w_->staging.size()) return false;
  for (const client::Lease& m : p.extent->members) {
    if (m.node < per_node_.size() && per_node_[m.node] + 1 > kMaxOpsPerNode) return false;
  }
  return true;
}

size_t Round::StageBytes(const Piece& p) const {
  return static_cast<size_t>(p.npages * params_.frag_size) * p.extent->members.size();
}

Status Round::Add(Piece p) {
  if (params_.codec) {
    p.stage = w_->staging.data() + stage_used_;
    stage_used_ += StageBytes(p);
  }
  pieces_[count_] = p;
  Piece& q = pieces_[count_];
  const size_t pi = count_++;
  const client::Resilience& res = params_.resilience;
  const uint32_t live = q.extent->live_mask();
  const uint64_t len = q.npages * kPage;
  const uint32_t f = params_.frag_size;
  if (!q.write && params_.crypto != nullptr) {
    // Open needs the pages' table entries when the ciphertext arrives: load them meanwhile.
    params_.crypto->Prefetch(q.index * params_.extent_pages + q.first_page, q.npages);
  }
  if (res.mode == Resilience::Mode::kErasure) {
    const size_t flen = static_cast<size_t>(q.npages) * f;
    const int n = res.k + res.r;
    if (q.write) {
      // Fragment j of page p: bytes [j*f, (j+1)*f) of the page, gathered into stage array j.
      for (uint64_t pg = 0; pg < q.npages; ++pg) {
        for (int j = 0; j < res.k; ++j) {
          std::memcpy(q.stage + static_cast<size_t>(j) * flen + pg * f,
                      q.buf + pg * kPage + static_cast<uint64_t>(j) * f, f);
        }
      }
      const uint8_t* data[kMaxMembers];
      uint8_t* parity[kMaxMembers];
      for (int j = 0; j < res.k; ++j) data[j] = q.stage + static_cast<size_t>(j) * flen;
      for (int j = 0; j < res.r; ++j) parity[j] = q.stage + static_cast<size_t>(res.k + j) * flen;
      FARMEM_RETURN_IF_ERROR(params_.codec->Encode({data, static_cast<size_t>(res.k)},
                                                   {parity, static_cast<size_t>(res.r)}, flen));
    }
    for (int j = 0; j < n; ++j) {
      if (!((live >> j) & 1)) continue;
      Post(pi, j, q.write, q.first_page * f, q.stage + static_cast<size_t>(j) * flen,
           static_cast<uint32_t>(flen));
    }
    return Status::Ok();
  }
  const uint64_t off = q.first_page * kPage;
  if (q.write) {
    for (size_t j = 0; j < q.extent->members.size(); ++j) {
      if ((live >> j) & 1)
        Post(pi, static_cast<int>(j), true, off, q.buf, static_cast<uint32_t>(len));
    }
  } else {
    // One replica, spread over the live ones by page.
    const int nm = static_cast<int>(q.extent->members.size());
    for (int t = 0; t < nm; ++t) {
      const int j =
          static_cast<int>((q.first_page + static_cast<uint64_t>(t)) % static_cast<uint64_t>(nm));
      if ((live >> j) & 1) {
        Post(pi, j, false, off, q.buf, static_cast<uint32_t>(len));
        break;
      }
    }
  }
  return Status::Ok();
}

void Round::Run() {
  // A daemon declared down while our ops to it are in flight (a gray failure: SIGSTOP, a
  // partition) must not hold this round, and the extent locks, for op_timeout: the set looks for
  // such daemons every client::kDownCheckInterval and fails their ops.
  w_->channels.RunBatch(
      std::span<RemoteOp>(ops_), DeadlineIn(params_.op_timeout),
      [&](size_t i, const Status& s) { Complete(i, s); },
      [&] {
        if (Satisfied()) return true;
        if (early_ != nullptr) SettleEarly();
        return false;
      });
}

void Round::Post(size_t piece, int member, bool write, uint64_t offset, uint8_t* local,
                 uint32_t len) {
  Piece& p = pieces_[piece];
  const client::Lease& m = p.extent->members[static_cast<size_t>(member)];
  RemoteOp r;
  r.node = m.node;
  r.op = {write ? transport::OpType::kWrite : transport::OpType::kRead,
          m.slab(),
          offset,
          local,
          len,
          nullptr,
          0};
  r.piece = piece;
  r.member = member;
  if (per_node_.size() <= m.node) per_node_.resize(m.node + 1, 0);
  ++per_node_[m.node];
  p.posted_mask |= 1u << member;
  ops_.push_back(std::move(r));
}

void Round::Complete(size_t i, const Status& s) {
  const RemoteOp& r = ops_[i];
  Piece& p = pieces_[r.piece];
  if (s.ok()) {
    p.ok_mask |= 1u << r.member;
    if (p.arrived < kMaxMembers) p.order[p.arrived++] = static_cast<int8_t>(r.member);
  } else {
    p.fail_mask |= 1u << r.member;
    if (p.first_error.ok()) {
      p.first_error = s.WithContext(
          fmt::format("lease {:#x} on {}", p.extent->members[static_cast<size_t>(r.member)].id(),
                      cluster_->node(r.node).endpoint.ToString()));
    }
    cluster_->ReportFailure(r.node, s);
  }
}

void Round::SettleEarly() {
  bool reported = false;
  const int k = params_.resilience.k;
  for (size_t i = 0; i < count_; ++i) {
    Piece& p = pieces_[i];
    if (p.settled || p.posted_mask == 0 || !op_status_[p.op].ok()) continue;
    if (early_->pieces_left[p.op] == 0) continue;  // not reported early
    if (p.write) {
      if (p.ok_mask != p.posted_mask) continue;
      p.MarkWritten();
    } else {
      const bool enough = params_.codec ? std::popcount(p.ok_mask) >= k : p.ok_mask != 0;
      if (!enough || p.fail_mask != 0) continue;
      bool decoded = false;
      if (!FinishRead(params_, *w_, i, p, &decoded).ok()) continue;  // RunPieces reports it
      decoded_reads_ += decoded ? 1 : 0;
      if (p.bad != 0) continue;  // a page failed authentication: RunPieces looks for a good copy
    }
    p.settled = true;
    if (--early_->pieces_left[p.op] == 0) {
      early_->ops[p.op].status = Status::Ok();
      early_->listener->OpDone(p.op);
      reported = true;
    }
  }
  if (reported) early_->listener->Progress();
}

bool Round::Satisfied() const {
  const bool ec_read_early = params_.codec != nullptr;
  for (const RemoteOp& r : ops_) {
    if (r.done) continue;
    const Piece& p = pieces_[r.piece];
    if (ec_read_early && !p.write && std::popcount(p.ok_mask) >= params_.resilience.k) {
      continue;  // late binding: this piece has its k fragments
    }
    if (ec_read_early && !p.write &&
        std::popcount(p.posted_mask & ~p.fail_mask) < params_.resilience.k) {
      continue;  // can never reach k: no point waiting for the rest
    }
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// A member copy's operations

Status RunCopyOps(const RoundParams& params, client::Cluster* cluster, Worker& w,
                  std::span<CopyOp> ops) {
  Status first;
  // The wait is Round::Run's: the set cuts it at a daemon declared down, by the clock.
  w.channels.RunBatch(ops, DeadlineIn(params.op_timeout), [&](size_t i, const Status& s) {
    CopyOp& o = ops[i];
    o.status = s;
    if (s.ok()) return;
    if (first.ok()) {
      first = s.WithContext(fmt::format("lease {:#x} on {}", o.op.slab.lease_id,
                                        cluster->node(o.node).endpoint.ToString()));
    }
    cluster->ReportFailure(o.node, s);
  });
  return first;
}

}  // namespace farmem::blockdev::pagestore

// ---------------------------------------------------------------------------------------------
// RunPieces

namespace farmem::blockdev {

using namespace pagestore;

namespace {
// The extents of a round are held shared from the piece that first needs one until the round is
// over: a set of locks that varies at run time, which the analysis cannot follow. These two are
// the only places that take and drop them.
void LockForRound(std::vector<Extent*>& locked, Extent* e) NO_THREAD_SAFETY_ANALYSIS {
  e->mu.LockShared();
  locked.push_back(e);
}
void UnlockRound(std::vector<Extent*>& locked) NO_THREAD_SAFETY_ANALYSIS {
  for (Extent* e : locked) e->mu.UnlockShared();
  locked.clear();
}
void LogRequestError(const Status& s) {
  uint64_t left_out = 0;
  if (RequestErrorLog().Allow(&left_out)) {
    spdlog::error("page store: {}{}", s.message(), Suppressed(left_out));
  }
}
}  // namespace

void PageStore::RunPieces(Worker& w, std::vector<Piece>& pieces, std::span<Status> op_status,
                          int attempt, Early* early) {
  std::vector<Piece> retry;
  std::vector<Piece> held;  // no member can serve them now, but one may come back
  std::vector<uint64_t> rebuild_now;
  size_t next = 0;
  while (next < pieces.size()) {
    w.channels.DrainStragglers();  // the staging memory of the last round is about to be reused
    Round round(*round_params_, cluster_, &w, op_status, early);
    // Held shared until the end of this round (UnlockRound below): the worker's vector, reused.
    std::vector<Extent*>& locked = w.locked;
    while (next < pieces.size()) {
      Piece& p = pieces[next];
      if (!op_status[p.op].ok()) {  // an earlier piece of this op failed for good
        ++next;
        continue;
      }
      if (p.write && !p.extent->mapped.load(std::memory_order_acquire)) {
        if (Status s = MapExtent(p.index); !s.ok()) {
          op_status[p.op] = s;
          ++next;
          continue;
        }
      }
      if (std::find(locked.begin(), locked.end(), p.extent) == locked.end()) {
        if (!round.empty() && locked.size() >= kMaxRoundExtents) break;
        LockForRound(locked, p.extent);
      }
      if (p.write && !p.extent->mapped.load(std::memory_order_acquire)) {
        continue;  // unmapped by a trim in between: map again (we hold it shared: fine)
      }
      if (p.write) p.MarkDirty();  // before anything is posted (a member copy redoes it)
      if (!p.write) {
        // Pages never written read as zeroes; lost pages are errors.
        bool any = false;
        for (uint64_t pg = 0; pg < p.npages; ++pg) {
          const uint64_t page = p.first_page + pg;
          if (p.extent->Test(p.extent->lost, page)) {
            op_status[p.op] = IoError(fmt::format(
                "export page {} (offset {}) was lost with its daemon and has not been written "
                "since",
                (p.index * extent_bytes_) / kPage + page, p.index * extent_bytes_ + page * kPage));
            LogRequestError(op_status[p.op]);
          }
          any = any || p.extent->Test(p.extent->written, page);
        }
        if (!any || !p.extent->mapped.load(std::memory_order_acquire) || !op_status[p.op].ok()) {
          if (op_status[p.op].ok()) std::memset(p.buf, 0, p.npages * kPage);
          ++next;
          continue;
        }
      }
      if (p.extent->live_mask() == 0 ||
          (codec_ && std::popcount(p.extent->live_mask()) < options_.resilience.k)) {
        // No remote copy can serve or take this piece.
        if (!p.write && backup_) {
          op_status[p.op] = backup_->Read(p.index * extent_bytes_ + p.first_page * kPage,
                                          {p.buf, p.npages * kPage});
          if (op_status[p.op].ok() && crypto_) op_status[p.op] = OpenFromBackup(w, p);
          CountStat(&PageStoreStats::backup_reads);
          CountStat(&PageStoreStats::degraded_reads);
        } else if (p.write && backup_) {
          // The data is in the backup file (DoWrite wrote it first): the write stands there,
          // and no member has it.
          p.MarkWritten();
          p.extent->stale.fetch_or(p.extent->all_mask(), std::memory_order_acq_rel);
        } else if (attempt <= kMaxRetries && MembersMayReturn(*p.extent)) {
          // Not lost (yet): its daemon may answer again as it was (a pause, a false down).
          // Wait for that, outside the locks, rather than fail the request (page_store_rebuild.cc).
          held.push_back(p);
        } else {
          op_status[p.op] = IoError(fmt::format(
              "export bytes {}..{}: every daemon holding them failed and there is no backup file",
              p.index * extent_bytes_ + p.first_page * kPage,
              p.index * extent_bytes_ + (p.first_page + p.npages) * kPage));
          LogRequestError(op_status[p.op]);
        }
        ++next;
        continue;
      }
      if (!round.Fits(p)) break;
      if (Status s = round.Add(p); !s.ok()) {
        op_status[p.op] = s;
      }
      ++next;
    }
    if (round.empty()) {
      UnlockRound(locked);
      continue;
    }
    round.Run();
    if (round.decoded_reads() > 0)
      CountStat(&PageStoreStats::degraded_reads, round.decoded_reads());
    // Outcomes, still under the extent locks.
    const int k = options_.resilience.k;
    for (size_t i = 0; i < round.size(); ++i) {
      Piece& p = round.piece(i);
      if (p.fail_mask != 0) {  // also a straggler of a piece settled early
        p.extent->failed.fetch_or(p.fail_mask, std::memory_order_acq_rel);
        NoteDegraded();
        QueueRebuild(p.index);
      }
      if (p.write) {
        // Members this write went past (failed, or failing now) while others or the backup file
        // took it are stale: never revalidated should their daemon answer again.
        const uint32_t missed = p.extent->all_mask() & ~p.ok_mask;
        if (missed != 0 && (p.ok_mask != 0 || backup_)) {
          p.extent->stale.fetch_or(missed, std::memory_order_acq_rel);
        }
      }
      if (p.settled) continue;
      const bool ec = codec_ != nullptr;
      if (p.write) {
        const int ok = std::popcount(p.ok_mask);
        const bool recoverable = ec ? ok >= k : ok >= 1;
        if (recoverable || backup_) {
          p.MarkWritten();
          if (p.fail_mask != 0) rebuild_now.push_back(p.index);
        } else {
          retry.push_back(p);
        }
        continue;
      }
      // Reads.
      if (!ec) {
        if (p.ok_mask != 0) {
          if (p.fail_mask != 0) CountStat(&PageStoreStats::degraded_reads);
        } else {
          retry.push_back(p);
          continue;
        }
      } else if (std::popcount(p.ok_mask) < k) {
        retry.push_back(p);
        continue;
      }
      bool decoded = false;
      if (Status s = FinishRead(*round_params_, w, i, p, &decoded); !s.ok()) op_status[p.op] = s;
      if (decoded) CountStat(&PageStoreStats::degraded_reads);
    }
    if (!w.bad_pages.empty()) {
      // Pages that failed authentication: treated as failed members (page_store_integrity.cc),
      // still under the round's locks; the channels must be idle for the member reads.
      w.channels.DrainStragglers();
      for (const BadPage& b : w.bad_pages) {
        Piece& p = round.piece(b.piece);
        if (!op_status[p.op].ok()) continue;
        if (Status s = RecoverPage(w, p, b.page); !s.ok()) op_status[p.op] = s;
      }
      w.bad_pages.clear();
    }
    UnlockRound(locked);  // the round is over: its extents may be taken exclusively again
  }
  // Writes that lost redundancy: make the group whole again before acknowledging, when a daemon
  // is there to take the lost members (otherwise the group runs degraded, said in the log).
  std::sort(rebuild_now.begin(), rebuild_now.end());
  rebuild_now.erase(std::unique(rebuild_now.begin(), rebuild_now.end()), rebuild_now.end());
  for (uint64_t index : rebuild_now) (void)RebuildExtent(w, index, /*wait=*/false);
  if (!held.empty()) {
    std::vector<Extent*> extents;
    for (const Piece& p : held) {
      if (std::find(extents.begin(), extents.end(), p.extent) == extents.end()) {
        extents.push_back(p.extent);
      }
    }
    const auto wait = MemberReturnWait();
    if (WaitForMembers(extents, Clock::now() + wait)) {
      // Back, or known gone (then the next attempt rebuilds or reports the pages lost).
      for (Piece& p : held) p.ResetForRetry();
      RunPieces(w, held, op_status, attempt + 1, early);
    } else {
      for (const Piece& p : held) {
        if (!op_status[p.op].ok()) continue;
        op_status[p.op] = IoError(fmt::format(
            "export bytes {}..{}: the daemon holding them is down and neither answered again nor "
            "was given up within {} ms",
            p.index * extent_bytes_ + p.first_page * kPage,
            p.index * extent_bytes_ + (p.first_page + p.npages) * kPage, wait.count()));
        LogRequestError(op_status[p.op]);
      }
    }
  }
  if (!retry.empty()) {
    CountStat(&PageStoreStats::write_retries, retry.size());
    if (attempt + 1 >= kMaxRetries) {
      for (const Piece& p : retry) {
        if (op_status[p.op].ok()) {
          op_status[p.op] =
              IoError(fmt::format("export bytes {}..{}: {} failed on too many daemons ({})",
                                  p.index * extent_bytes_ + p.first_page * kPage,
                                  p.index * extent_bytes_ + (p.first_page + p.npages) * kPage,
                                  p.write ? "write" : "read", p.first_error.ToString()));
          LogRequestError(op_status[p.op]);
        }
      }
      return;
    }
    for (Piece& p : retry) p.ResetForRetry();
    for (const Piece& p : retry) (void)RebuildExtent(w, p.index, /*wait=*/false);
    RunPieces(w, retry, op_status, attempt + 1, early);
  }
}

}  // namespace farmem::blockdev
