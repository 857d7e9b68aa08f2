// RemoteStore data path: writing span sets, reading one span (degraded when its daemon is gone).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "farmem/spanstore/remote_store.h"

namespace farmem::spanstore {

bool NodeGone(const Status& s) {
  switch (s.code()) {
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kExpired:
    case StatusCode::kNotFound:
    case StatusCode::kRemoteAccessError:
    case StatusCode::kPermissionDenied:
    case StatusCode::kAborted:
      return true;
    default:
      return false;
  }
}

void RemoteStore::RunOps(IoContext& io, std::span<transport::Op> ops,
                         std::span<const client::NodeId> nodes, std::span<Status> results) {
  // At most one read round's worth of operations (a span set's, or ReadSpans'): everything
  // lives on the stack.
  if (ops.size() > static_cast<size_t>(kMaxReadRound)) {
    for (size_t i = 0; i < ops.size(); i += kMaxReadRound) {
      const size_t n = std::min<size_t>(kMaxReadRound, ops.size() - i);
      RunOps(io, ops.subspan(i, n), nodes.subspan(i, n), results.subspan(i, n));
    }
    return;
  }
  client::BatchOp batch[kMaxReadRound];
  for (size_t i = 0; i < ops.size(); ++i) batch[i] = {nodes[i], ops[i]};
  // A gray failure (a daemon paused or cut off with its sockets open) breaks nothing: once the
  // cluster has declared such a daemon down, the ops still waiting on it end (Unavailable), so the
  // caller reads degraded from the other members instead of waiting out op_timeout.
  io.channels.RunBatch(std::span<client::BatchOp>(batch, ops.size()), DeadlineIn(op_timeout_),
                       [&](size_t i, const Status& s) {
                         results[i] = s;
                         if (!s.ok()) return;
                         if (ops[i].type == transport::OpType::kRead) {
                           io.bytes_read += ops[i].length;
                         } else {
                           io.bytes_written += ops[i].length;
                         }
                       });
}

Status RemoteStore::SetCells(std::span<const uint8_t* const> data, uint8_t* parity,
                             const uint8_t** cells, uint32_t* live) const {
  const int k = res_.k;
  const int n = res_.group_size();
  *live = DataCells(data, cells);
  if (res_.mode == client::Resilience::Mode::kErasure && res_.r > 0) {
    uint8_t* out[kMaxSetWidth];
    for (int j = 0; j < res_.r; ++j) out[j] = parity + static_cast<size_t>(j) * span_size_;
    FARMEM_RETURN_IF_ERROR(codec_->Encode({cells, static_cast<size_t>(k)},
                                          {out, static_cast<size_t>(res_.r)}, span_size_));
    for (int j = 0; j < res_.r; ++j) cells[k + j] = out[j];
  } else if (res_.mode == client::Resilience::Mode::kReplicate) {
    for (int j = 1; j < n; ++j) cells[j] = cells[0];
  }
  return Status::Ok();
}

bool RemoteStore::FinishSetWrite(IoContext& io, SpanSet* set,
                                 std::span<const client::Lease> members, uint64_t epoch,
                                 uint32_t absent, const Status* results, uint32_t live,
                                 std::span<SpanOwner* const> spans, Status* last) {
  const int n = res_.group_size();
  bool ok = true;
  uint32_t gone = 0;  // members whose write failed because their slab or daemon is gone
  for (int m = 0; m < n; ++m) {
    if (results[m].ok() || ((absent >> m) & 1) != 0) continue;
    ok = false;
    *last = results[m];
    if (StaleChannel(io, members[static_cast<size_t>(m)].node)) continue;  // not the member's
    cluster_->ReportFailure(members[static_cast<size_t>(m)].node, results[m]);
    if (NodeGone(results[m])) gone |= 1u << m;
  }
  // Marking those members failed and deciding the commit is one hold of mu_: otherwise the
  // recovery thread could revalidate a member in between (its daemon answers heartbeats with
  // the lease: a gray failure, or a kill not noticed yet), and the set would see it healthy
  // but without its cell, and give its row up; four such tries fail the write.
  bool marked = false;
  struct SignalAfterUnlock {  // destroyed after `lock`
    CondVar& cv;
    const bool& on;
    ~SignalAfterUnlock() {
      if (on) cv.SignalAll();
    }
  } signal{recovery_cv_, marked};
  MutexLock lock(&mu_);
  for (int m = 0; m < n; ++m) {
    if (((gone >> m) & 1) == 0) continue;
    marked |= MarkFailedLocked(set->group, m, members[static_cast<size_t>(m)].id(), results[m]);
  }
  if (!ok) {
    // Members whose write failed and that are failed now (their daemon is gone: marked above,
    // or by another thread before) cost the set nothing while MinMembers() others hold their
    // cells: it is committed degraded, as if written to a degraded group (those members are
    // rebuilt with the group's other rows, never used again as they are). Otherwise a write in
    // the moments before a dead daemon is declared down gives its row up and tries a row of
    // another healthy group on the same daemon, and with every group there (k + r daemons)
    // fails after its four tries. A member that failed otherwise (a stale channel, an error
    // that says nothing of the slab) leaves its cell unknown: the row is given up.
    const uint32_t failed_now = set->group->failed_mask;
    uint32_t missing = absent;
    bool known = true;
    for (int m = 0; m < n; ++m) {
      if (results[m].ok() || ((absent >> m) & 1) != 0) continue;
      if (((failed_now >> m) & 1) == 0) known = false;
      missing |= 1u << m;
    }
    if (known && n - std::popcount(missing) >= MinMembers()) {
      ok = true;
      absent = missing;
    }
  }
  if (ok) {
    Group* g = set->group;
    if (g->rebuilding || g->epoch != epoch || g->lost_mask != 0) {
      // A member is being (or was) replaced while we wrote: re-protection did not see this
      // row. Or the group is beyond repair. The data is still in the caller's hands, so place
      // the set elsewhere rather than rebuild it. (A member that failed after we wrote it is
      // rebuilt with the group's other rows.)
      *last = Unavailable(fmt::format("slab group {} lost a member during the write", g->id));
      FreeRowLocked(set);
      return false;
    }
    if (absent != 0) ++degraded_sets_written_;
    g->stale_mask |= absent;  // those members miss this set's cells
    CommitRowLocked(set, live, spans);
    return true;
  }
  FreeRowLocked(set);
  return false;
}

Result<SpanSet*> RemoteStore::WriteSet(IoContext& io, std::span<const uint8_t* const> data,
                                       std::span<SpanOwner* const> spans) {
  const int k = res_.k;
  const int n = res_.group_size();
  const size_t span = span_size_;
  if (data.empty() || data.size() > static_cast<size_t>(k) || spans.size() != data.size()) {
    return Err(Internal(fmt::format("WriteSet with {} spans (k = {})", data.size(), k)));
  }
  // The k data cells (zeros where there is no span), then parity or copies.
  if (io.scratch.size() < span * static_cast<size_t>(n)) io.scratch.resize(span * n);
  const uint8_t* cells[kMaxSetWidth];
  uint32_t live = 0;
  FARMEM_RETURN_IF_ERROR(SetCells(data, io.scratch.data(), cells, &live));
  Status last;
  for (int attempt = 0; attempt < 4; ++attempt) {
    SetMembers members;
    uint64_t epoch = 0;
    uint32_t absent = 0;  // members missing from a degraded group: nothing to write there
    FARMEM_ASSIGN_OR_RETURN(SpanSet * set, ReserveRow(true, &members, &epoch, &absent));
    Status results[kMaxSetWidth];
    const uint64_t off = static_cast<uint64_t>(set->row) * span;
    WriteCells(io, members, off, {cells, static_cast<size_t>(n)}, results, absent);
    if (FinishSetWrite(io, set, members, epoch, absent, results, live, spans, &last)) {
      return set;
    }
  }
  return Err(last.WithContext("writing a span set"));
}

void RemoteStore::WriteSets(IoContext& io, std::span<const std::span<const uint8_t* const>> data,
                            std::span<const std::span<SpanOwner* const>> spans,
                            std::span<Result<SpanSet*>> out) {
  const size_t count = data.size();
  const int k = res_.k;
  const int n = res_.group_size();
  const size_t span = span_size_;
  if (count > kMaxBatchSets) {
    for (size_t i = 0; i < count; i += kMaxBatchSets) {
      const size_t c = std::min(kMaxBatchSets, count - i);
      WriteSets(io, data.subspan(i, c), spans.subspan(i, c), out.subspan(i, c));
    }
    return;
  }
  if (count == 1) {
    out[0] = WriteSet(io, data[0], spans[0]);
    return;
  }
  // Every set's cells (parity in io.scratch, one set's worth each) and row first, then all their
  // writes in one batch; a set whose write failed goes again alone (WriteSet, which retries).
  struct Pending {
    SpanSet* set = nullptr;
    SetMembers members;
    uint64_t epoch = 0;
    uint32_t absent = 0;
    uint32_t live = 0;
    const uint8_t* cells[kMaxSetWidth];
    Status results[kMaxSetWidth];
  };
  Pending p[kMaxBatchSets];
  if (io.scratch.size() < span * static_cast<size_t>(n) * count) {
    io.scratch.resize(span * static_cast<size_t>(n) * count);
  }
  client::BatchOp ops[kMaxBatchSets * kMaxSetWidth];
  size_t nops = 0;
  size_t where[kMaxBatchSets * kMaxSetWidth];  // op -> set * kMaxSetWidth + member
  for (size_t i = 0; i < count; ++i) {
    if (data[i].empty() || data[i].size() > static_cast<size_t>(k) ||
        spans[i].size() != data[i].size()) {
      out[i] = Err(Internal(fmt::format("WriteSets with {} spans (k = {})", data[i].size(), k)));
      continue;
    }
    if (Status s = SetCells(data[i], io.scratch.data() + i * span * static_cast<size_t>(n),
                            p[i].cells, &p[i].live);
        !s.ok()) {
      out[i] = Err(s);
      continue;
    }
    Result<SpanSet*> set = ReserveRow(true, &p[i].members, &p[i].epoch, &p[i].absent);
    if (!set) {
      out[i] = Err(set.error());
      continue;
    }
    p[i].set = *set;
    const uint64_t off = static_cast<uint64_t>(p[i].set->row) * span;
    for (int m = 0; m < n; ++m) {
      if (((p[i].absent >> m) & 1) != 0) continue;
      const client::Lease& l = p[i].members[static_cast<size_t>(m)];
      ops[nops] = {l.node,
                   {transport::OpType::kWrite, l.slab(), off, const_cast<uint8_t*>(p[i].cells[m]),
                    static_cast<uint32_t>(span), nullptr, 0},
                   false};
      where[nops++] = i * kMaxSetWidth + static_cast<size_t>(m);
    }
  }
  io.channels.RunBatch(std::span<client::BatchOp>(ops, nops), DeadlineIn(op_timeout_),
                       [&](size_t j, const Status& s) {
                         p[where[j] / kMaxSetWidth].results[where[j] % kMaxSetWidth] = s;
                         if (s.ok()) io.bytes_written += ops[j].op.length;
                       });
  for (size_t i = 0; i < count; ++i) {
    if (p[i].set == nullptr) continue;
    Status last;
    if (FinishSetWrite(io, p[i].set, p[i].members, p[i].epoch, p[i].absent, p[i].results, p[i].live,
                       spans[i], &last)) {
      out[i] = p[i].set;
    } else {
      out[i] = WriteSet(io, data[i], spans[i]);  // its own row, retried; recomputes the parity
    }
  }
}

void RemoteStore::ReadSpans(IoContext& io, std::span<SpanSet* const> sets,
                            std::span<const int> members, std::span<uint8_t* const> dsts,
                            std::span<Status> results, std::span<const Piece> pieces) {
  const size_t n = std::min<size_t>(sets.size(), kMaxReadRound);
  transport::Op ops[kMaxReadRound];
  client::NodeId nodes[kMaxReadRound];
  size_t index[kMaxReadRound];
  Status got[kMaxReadRound];
  size_t posted = 0;
  {
    MutexLock lock(&mu_);
    for (size_t i = 0; i < n; ++i) {
      const Group* g = sets[i]->group;
      const int m = members[i];
      results[i] = Unavailable("not read");
      if ((((g->failed_mask | g->lost_mask) >> m) & 1) != 0) continue;  // degraded: alone below
      const client::Lease& l = g->members[static_cast<size_t>(m)];
      Piece p{0, span_size_};
      if (!pieces.empty() && pieces[i].length > 0) {
        p = pieces[i];
        if (static_cast<uint64_t>(p.offset) + p.length > span_size_) continue;  // ReadSpan says
      }
      ops[posted] = {transport::OpType::kRead,
                     l.slab(),
                     static_cast<uint64_t>(sets[i]->row) * span_size_ + p.offset,
                     dsts[i],
                     p.length,
                     nullptr,
                     0};
      nodes[posted] = l.node;
      index[posted++] = i;
    }
  }
  RunOps(io, {ops, posted}, {nodes, posted}, {got, posted});
  bool ok[kMaxReadRound] = {};
  for (size_t j = 0; j < posted; ++j) {
    if (got[j].ok()) {
      results[index[j]] = Status::Ok();
      ok[index[j]] = true;
    }  // else ReadSpan below reads it again and reports the failure
  }
  const auto piece = [&](size_t i) { return pieces.empty() ? Piece{} : pieces[i]; };
  for (size_t i = 0; i < n; ++i) {
    if (!ok[i]) results[i] = ReadSpan(io, sets[i], members[i], dsts[i], piece(i));
  }
  for (size_t i = n; i < sets.size(); ++i) {
    results[i] = ReadSpan(io, sets[i], members[i], dsts[i], piece(i));
  }
}

void RemoteStore::WriteCells(IoContext& io, std::span<const client::Lease> members, uint64_t off,
                             std::span<const uint8_t* const> cells, Status* results,
                             uint32_t skip) {
  transport::Op ops[kMaxSetWidth];
  client::NodeId nodes[kMaxSetWidth];
  Status got[kMaxSetWidth];
  size_t index[kMaxSetWidth];
  size_t posted = 0;
  const size_t n = std::min<size_t>(cells.size(), kMaxSetWidth);
  for (size_t m = 0; m < n; ++m) {
    results[m] = Status::Ok();
    if (((skip >> m) & 1) != 0) continue;
    ops[posted] = {transport::OpType::kWrite,
                   members[m].slab(),
                   off,
                   const_cast<uint8_t*>(cells[m]),
                   span_size_,
                   nullptr,
                   0};
    nodes[posted] = members[m].node;
    index[posted++] = m;
  }
  RunOps(io, {ops, posted}, {nodes, posted}, {got, posted});
  for (size_t i = 0; i < posted; ++i) results[index[i]] = std::move(got[i]);
}

Status RemoteStore::ReadSpan(IoContext& io, SpanSet* set, int member, uint8_t* dst, Piece piece) {
  const bool whole = piece.length == 0;
  if (whole) {
    piece = {0, span_size_};
  } else if (static_cast<uint64_t>(piece.offset) + piece.length > span_size_) {
    return InvalidArgument(fmt::format("piece [{}, +{}) lies beyond a span of {} bytes",
                                       piece.offset, piece.length, span_size_));
  }
  const int k = res_.k;
  const int n = res_.group_size();
  const size_t span = span_size_;
  for (int attempt = 0; attempt < 4; ++attempt) {
    SetMembers members;  // a copy on the stack: a degraded read allocates nothing either
    uint32_t bad = 0;
    uint32_t row = 0;
    uint32_t set_id = 0;
    uint32_t group_id = 0;
    {
      MutexLock lock(&mu_);
      set->group->CopyMembers(&members);
      bad = set->group->failed_mask | set->group->lost_mask;
      row = set->row;
      set_id = set->id;
      group_id = set->group->id;
    }
    const uint64_t off = static_cast<uint64_t>(row) * span;
    // Normal case: one read of one span from its one daemon.
    if (((bad >> member) & 1) == 0) {
      transport::Op op{transport::OpType::kRead,
                       members[static_cast<size_t>(member)].slab(),
                       off + piece.offset,
                       dst,
                       piece.length,
                       nullptr,
                       0};
      client::NodeId node = members[static_cast<size_t>(member)].node;
      Status s;
      RunOps(io, {&op, 1}, {&node, 1}, {&s, 1});
      if (s.ok()) return s;
      if (StaleChannel(io, node)) continue;  // a channel to a restarted daemon: read again
      cluster_->ReportFailure(node, s);
      if (!NodeGone(s)) return s;
      MarkFailed(set->group, member, members[static_cast<size_t>(member)].id(), s);
      continue;  // look again: now degraded
    }
    // Degraded: rebuild the cell from survivors.
    int readers[kMaxSetWidth];
    size_t nreaders = 0;
    for (int m = 0; m < n; ++m) {
      if (((bad >> m) & 1) == 0) readers[nreaders++] = m;
    }
    const bool erasure = res_.mode == client::Resilience::Mode::kErasure && res_.r > 0;
    const size_t need = erasure ? static_cast<size_t>(k) : 1;
    if (nreaders < need) {
      std::string gone;
      for (int m = 0; m < n; ++m) {
        if (((bad >> m) & 1) == 0) continue;
        if (!gone.empty()) gone += ", ";
        gone += Vacant(members[static_cast<size_t>(m)])
                    ? MemberName(members[static_cast<size_t>(m)])
                    : fmt::format("{} (lease {})", MemberName(members[static_cast<size_t>(m)]),
                                  members[static_cast<size_t>(m)].id());
      }
      return DataLoss(fmt::format(
          "it lived in span set {} (slab group {}, row {}) whose members on {} are gone; "
          "resilience {} can rebuild a span only while at most {} of its {} daemons are gone",
          set_id, group_id, row, gone, res_.ToString(),
          res_.mode == client::Resilience::Mode::kNone ? 0 : n - static_cast<int>(need), n));
    }
    nreaders = need;
    if (io.scratch.size() < span * static_cast<size_t>(n)) io.scratch.resize(span * n);
    transport::Op ops[kMaxSetWidth];
    client::NodeId nodes[kMaxSetWidth];
    Status results[kMaxSetWidth];
    uint8_t* frags[kMaxSetWidth];
    for (int m = 0; m < n; ++m) frags[m] = io.scratch.data() + static_cast<size_t>(m) * span;
    // The cell is rebuilt whole: into dst, or for a piece into the scratch, then copied out.
    if (whole) frags[member] = dst;
    uint8_t* const cell = frags[member];
    for (size_t i = 0; i < nreaders; ++i) {
      const int m = readers[i];
      ops[i] = {transport::OpType::kRead,
                members[static_cast<size_t>(m)].slab(),
                off,
                erasure ? frags[m] : cell,
                static_cast<uint32_t>(span),
                nullptr,
                0};
      nodes[i] = members[static_cast<size_t>(m)].node;
    }
    RunOps(io, {ops, nreaders}, {nodes, nreaders}, {results, nreaders});
    bool ok = true;
    for (size_t i = 0; i < nreaders; ++i) {
      if (results[i].ok()) continue;
      ok = false;
      if (StaleChannel(io, nodes[i])) continue;
      cluster_->ReportFailure(nodes[i], results[i]);
      if (NodeGone(results[i])) {
        MarkFailed(set->group, readers[i], members[static_cast<size_t>(readers[i])].id(),
                   results[i]);
      }
    }
    if (!ok) continue;
    if (erasure) {
      FARMEM_RETURN_IF_ERROR(
          codec_->ReconstructData({frags, static_cast<size_t>(n)}, {readers, nreaders}, span));
    }
    if (!whole) std::memcpy(dst, cell + piece.offset, piece.length);
    MutexLock lock(&mu_);
    ++degraded_reads_;
    return Status::Ok();
  }
  return Unavailable("daemons kept failing");
}

}  // namespace farmem::spanstore
