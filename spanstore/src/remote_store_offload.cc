// RemoteStore parity offload: a span set whose parity cells are computed by the daemons that
// store them (PARITY_ENCODE, docs/wire-protocol.md) instead of by the client.
//
// Why: the compactor writes whole new span sets. Encoding them here costs client CPU, and
// sending the r parity cells costs r / (k + r) of the bytes it writes. Each parity daemon can
// instead read the k data cells from their daemons (one READ each, pipelined) and fold them into
// its cell with ec_encode_data_update as they arrive; the client sends one small request per
// parity member. The traffic moves to the daemons' links (r * k cells instead of r), which is
// the trade Carbink makes too: memory nodes have idle CPU and NICs, the compute node does not.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "farmem/common/wire_gather.h"
#include "farmem/spanstore/remote_store.h"

namespace farmem::spanstore {

namespace {
// The largest success reply body CallAll keeps (GATHER_CELL's: 8 + 4 per source, <= 136 B).
constexpr uint32_t kMaxCallReply = 4096;
}  // namespace

transport::TcpConnection* RemoteStore::CallConnectionFor(IoContext& io, client::NodeId node,
                                                         Status* error) {
  if (io.calls.size() <= node) io.calls.resize(node + 1);
  auto& conn = io.calls[node];
  if (conn && conn->broken()) conn.reset();
  if (!conn) {
    auto c = cluster_->ControlConnection(node);
    if (!c) {
      *error = c.error();
      return nullptr;
    }
    conn = std::make_unique<transport::TcpConnection>(std::move(*c));
  }
  return conn.get();
}

Result<SpanSet*> RemoteStore::WriteSetOffloaded(IoContext& io, std::span<const uint8_t* const> data,
                                                std::span<SpanOwner* const> spans,
                                                Status* offload_error) {
  *offload_error = Status::Ok();
  const int k = res_.k;
  const int r = res_.r;
  const size_t span = span_size_;
  if (res_.mode != client::Resilience::Mode::kErasure || r == 0) return WriteSet(io, data, spans);
  if (data.empty() || data.size() > static_cast<size_t>(k) || spans.size() != data.size()) {
    return Err(Internal(fmt::format("WriteSetOffloaded with {} spans (k = {})", data.size(), k)));
  }
  auto fall_back = [&](SpanSet* set, Status why) -> Result<SpanSet*> {
    if (set != nullptr) {
      MutexLock lock(&mu_);
      FreeRowLocked(set);
    }
    spdlog::debug("far memory: parity offload failed, writing the set with client parity: {}",
                  why.ToString());
    *offload_error = std::move(why);
    return WriteSet(io, data, spans);
  };
  const uint8_t* cells[kMaxSetWidth];
  const uint32_t live = DataCells(data, cells);
  SetMembers members;
  uint64_t epoch = 0;
  uint32_t absent = 0;
  // Only complete groups: a degraded one has no parity daemon to offload to. WriteSet writes
  // degraded when it must.
  Result<SpanSet*> reserved = ReserveRow(false, &members, &epoch, &absent);
  if (!reserved) return fall_back(nullptr, reserved.error());
  SpanSet* set = *reserved;
  const uint64_t off = static_cast<uint64_t>(set->row) * span;

  // 1. The k data cells, as WriteSet writes them.
  Status results[kMaxSetWidth];
  WriteCells(io, members, off, {cells, static_cast<size_t>(k)}, results);
  for (int m = 0; m < k; ++m) {
    if (results[m].ok()) continue;
    if (StaleChannel(io, members[static_cast<size_t>(m)].node)) {
      return fall_back(set, results[m].WithContext("writing a data cell"));
    }
    cluster_->ReportFailure(members[static_cast<size_t>(m)].node, results[m]);
    if (NodeGone(results[m])) {
      MarkFailed(set->group, m, members[static_cast<size_t>(m)].id(), results[m]);
    }
    return fall_back(set, results[m].WithContext("writing a data cell"));
  }

  // 2. Each parity daemon computes its cell from the k data cells. The daemon must answer
  // before we give up on it: half our budget for its reads.
  if (Status s = EncodeParityRemotely(
          io, members, off, static_cast<uint32_t>(std::max<int64_t>(1, op_timeout_.count() / 2)));
      !s.ok()) {
    return fall_back(set, s);
  }

  // 3. Commit, exactly as WriteSet does.
  {
    MutexLock lock(&mu_);
    Group* g = set->group;
    if (g->failed_mask == 0 && g->lost_mask == 0 && !g->rebuilding && g->epoch == epoch) {
      CommitRowLocked(set, live, spans);
      return set;
    }
  }
  // A member failed while we wrote: re-protection did not see this row; place it elsewhere.
  return fall_back(set, Unavailable("a member of the slab group failed during the write"));
}

Status RemoteStore::EncodeParityRemotely(IoContext& io, std::span<const client::Lease> members,
                                         uint64_t off, uint32_t timeout_ms) {
  const int k = res_.k;
  const int r = res_.r;
  wire::ParityEncodeRequest req;
  req.offset = off;
  req.length = span_size_;
  req.k = static_cast<uint8_t>(k);
  req.r = static_cast<uint8_t>(r);
  req.timeout_ms = timeout_ms;
  for (int m = 0; m < k; ++m) {
    const Endpoint ep = cluster_->node(members[static_cast<size_t>(m)].node).endpoint;
    req.sources.push_back({ep.host, ep.port, members[static_cast<size_t>(m)].id(), off});
  }
  std::vector<std::vector<uint8_t>> bodies(static_cast<size_t>(r));
  client::NodeId nodes[kMaxSetWidth];
  for (int j = 0; j < r; ++j) {
    const client::Lease& target = members[static_cast<size_t>(k + j)];
    req.lease_id = target.id();
    req.parity_index = static_cast<uint8_t>(j);
    wire::EncodeParityEncode(req, &bodies[static_cast<size_t>(j)]);
    nodes[j] = target.node;
  }
  return CallAll(io, wire::Opcode::kParityEncode, {nodes, static_cast<size_t>(r)}, bodies);
}

Status RemoteStore::CallAll(IoContext& io, wire::Opcode op, std::span<const client::NodeId> nodes,
                            std::span<const std::vector<uint8_t>> bodies,
                            std::vector<std::vector<uint8_t>>* replies) {
  const Deadline deadline = DeadlineIn(op_timeout_);
  const size_t n = nodes.size();
  std::vector<transport::TcpConnection*> conns(n, nullptr);
  std::vector<uint64_t> ids(n, 0);
  Status first;
  auto note = [&](size_t i, Status s) {
    if (first.ok()) {
      first = s.WithContext(fmt::format("{} to {}", wire::OpcodeName(static_cast<uint8_t>(op)),
                                        cluster_->node(nodes[i]).endpoint.ToString()));
    }
  };
  size_t sent = 0;
  for (; sent < n; ++sent) {
    const size_t i = sent;
    Status err;
    transport::TcpConnection* conn = CallConnectionFor(io, nodes[i], &err);
    if (conn == nullptr) {
      note(i, err);
      break;
    }
    Result<uint64_t> id = conn->Send(op, bodies[i], deadline);
    if (!id) {
      note(i, id.error());
      break;
    }
    io.offload_bytes_sent += wire::kHeaderSize + bodies[i].size();
    conns[i] = conn;
    ids[i] = *id;
  }
  if (replies != nullptr) replies->assign(n, {});
  for (size_t i = 0; i < sent; ++i) {
    // An error's body is its message (in the Status); a success's is kept if asked for.
    Result<transport::TcpConnection::Reply> r = conns[i]->Receive(ids[i], {}, deadline);
    if (!r) {
      note(i, r.error());
      continue;
    }
    io.offload_bytes_received += wire::kHeaderSize + r->body_len;
    if (replies == nullptr || r->body_len == 0 || r->in_place) continue;
    if (r->body_len > kMaxCallReply) {
      note(i, ProtocolError(fmt::format("a reply of {} bytes (at most {} expected)", r->body_len,
                                        kMaxCallReply)));
      continue;  // the next Receive drops the body
    }
    (*replies)[i].resize(r->body_len);
    if (Status st = conns[i]->ReadBody((*replies)[i]); !st.ok()) note(i, st);
  }
  return first;
}

Result<SpanSet*> RemoteStore::WriteSetGathered(IoContext& io,
                                               std::span<const std::vector<GatherPiece>> cells,
                                               std::span<SpanOwner* const> spans,
                                               std::span<uint32_t> cell_crcs,
                                               std::vector<std::pair<SpanSet*, int>>* corrupt) {
  const int k = res_.k;
  const int r = res_.r;
  const size_t span = span_size_;
  if (res_.mode != client::Resilience::Mode::kErasure || r == 0) {
    return Err(Unimplemented("compaction offload needs erasure coding with parity"));
  }
  if (cells.empty() || cells.size() > static_cast<size_t>(k) || spans.size() != cells.size() ||
      cell_crcs.size() != cells.size()) {
    return Err(Internal(fmt::format("WriteSetGathered with {} cells (k = {})", cells.size(), k)));
  }
  const uint32_t timeout_ms =
      static_cast<uint32_t>(std::clamp<int64_t>(op_timeout_.count() / 2, 1, 60000));
  // Where the pieces live now. Their spans are locked by the caller, so their sets stay.
  std::vector<wire::GatherCellRequest> reqs(static_cast<size_t>(k));
  // Per cell, per source: which cell it is and the checksum it was written with.
  struct Source {
    SpanSet* set;
    int member;
    uint32_t crc;
  };
  std::vector<std::vector<Source>> expect(static_cast<size_t>(k));
  {
    MutexLock lock(&mu_);
    for (size_t c = 0; c < cells.size(); ++c) {
      wire::GatherCellRequest& req = reqs[c];
      std::map<std::pair<const SpanSet*, int>, uint16_t> index;
      for (const GatherPiece& p : cells[c]) {
        const Group* g = p.set->group;
        if ((((g->failed_mask | g->lost_mask) >> p.member) & 1) != 0) {
          return Err(Unavailable(fmt::format(
              "span set {} member {} is degraded: its bytes must be rebuilt by the client",
              p.set->id, p.member)));
        }
        auto [it, fresh] =
            index.try_emplace({p.set, p.member}, static_cast<uint16_t>(req.sources.size()));
        if (fresh) {
          expect[c].push_back({p.set, p.member, p.cell_crc});
          const client::Lease& l = g->members[static_cast<size_t>(p.member)];
          const Endpoint ep = cluster_->node(l.node).endpoint;
          req.sources.push_back(
              {ep.host, ep.port, l.id(), static_cast<uint64_t>(p.set->row) * span});
        }
        req.copies.push_back({it->second, p.src_offset, p.dst_offset, p.length});
      }
      if (req.sources.size() > wire::kMaxGatherSources) {
        return Err(
            ResourceExhausted(fmt::format("a compacted span gathers from {} spans (limit {})",
                                          req.sources.size(), wire::kMaxGatherSources)));
      }
    }
  }
  SetMembers members;
  uint64_t epoch = 0;
  uint32_t absent = 0;
  FARMEM_ASSIGN_OR_RETURN(SpanSet * set, ReserveRow(false, &members, &epoch, &absent));
  auto give_up = [&](Status why) -> Result<SpanSet*> {
    MutexLock lock(&mu_);
    FreeRowLocked(set);
    return Err(std::move(why));
  };
  const uint64_t off = static_cast<uint64_t>(set->row) * span;

  // 1. Each data daemon assembles its cell (members past cells.size() get a zero cell).
  std::vector<std::vector<uint8_t>> bodies(static_cast<size_t>(k));
  client::NodeId nodes[kMaxSetWidth];
  for (int m = 0; m < k; ++m) {
    wire::GatherCellRequest& req = reqs[static_cast<size_t>(m)];
    req.lease_id = members[static_cast<size_t>(m)].id();
    req.offset = off;
    req.length = static_cast<uint32_t>(span);
    req.timeout_ms = timeout_ms;
    wire::EncodeGatherCell(req, &bodies[static_cast<size_t>(m)]);
    if (bodies[static_cast<size_t>(m)].size() > wire::kMaxControlBodyLen) {
      return give_up(ResourceExhausted(
          fmt::format("GATHER_CELL for a span of {} pieces exceeds the {}-byte control body limit",
                      req.copies.size(), wire::kMaxControlBodyLen)));
    }
    nodes[m] = members[static_cast<size_t>(m)].node;
  }
  std::vector<std::vector<uint8_t>> replies;
  if (Status s =
          CallAll(io, wire::Opcode::kGatherCell, {nodes, static_cast<size_t>(k)}, bodies, &replies);
      !s.ok()) {
    return give_up(s);
  }
  // Every source must be what it was written as: a cell that is not would carry its corruption
  // into the new set, under new parity, and the old set (the good copy) would be freed.
  std::string bad;
  for (int m = 0; m < k; ++m) {
    const auto& want = expect[static_cast<size_t>(m)];
    Result<wire::GatherCellReply> got =
        wire::DecodeGatherCellReply(replies[static_cast<size_t>(m)], want.size());
    if (!got) {
      return give_up(Unimplemented(fmt::format(
          "GATHER_CELL on {} did not report the checksums of the cells it read (a farmemd too "
          "old to check them?): {}",
          cluster_->node(nodes[m]).endpoint.ToString(), got.error().message())));
    }
    for (size_t i = 0; i < want.size(); ++i) {
      if (got->source_crcs[i] == want[i].crc) continue;
      const std::pair<SpanSet*, int> cell{want[i].set, want[i].member};
      if (std::find(corrupt->begin(), corrupt->end(), cell) != corrupt->end()) continue;
      corrupt->push_back(cell);
      bad += fmt::format("{}span set {} member {} (CRC-32C {:08x}, written as {:08x})",
                         bad.empty() ? "" : ", ", want[i].set->id, want[i].member,
                         got->source_crcs[i], want[i].crc);
    }
    if (static_cast<size_t>(m) < cell_crcs.size()) {
      cell_crcs[static_cast<size_t>(m)] = got->cell_crc;
    }
  }
  if (!bad.empty()) {
    return give_up(DataLoss("source cells corrupted on their daemons: " + bad));
  }

  // 2. Each parity daemon computes its cell from the k new data cells.
  if (Status s = EncodeParityRemotely(io, members, off, timeout_ms); !s.ok()) return give_up(s);

  // 3. Commit, as WriteSet does.
  MutexLock lock(&mu_);
  Group* g = set->group;
  if (g->failed_mask != 0 || g->lost_mask != 0 || g->rebuilding || g->epoch != epoch) {
    FreeRowLocked(set);
    return Err(Unavailable(fmt::format("slab group {} lost a member during the write", g->id)));
  }
  CommitRowLocked(set, (1u << cells.size()) - 1, spans);  // cells.size() <= k (checked above)
  return set;
}

}  // namespace farmem::spanstore
