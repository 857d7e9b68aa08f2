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

#include "remote_store.h"

namespace farmem::farptr_internal {

namespace {
// The codes after which a member's slab is taken to be gone (as in remote_store_io.cc).
bool NodeGoneForOffload(const Status& s) {
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
}  // namespace

transport::TcpConnection* RemoteStore::CallConnectionFor(IoContext& io, client::NodeId node,
                                                         Status* error) {
  if (io.calls.size() <= node) io.calls.resize(node + 1);
  auto& conn = io.calls[node];
  if (conn && conn->broken()) conn.reset();
  if (!conn) {
    const client::NodeInfo info = cluster_->node(node);
    if (!info.alive) {
      *error = Unavailable(fmt::format("daemon {} is down", info.endpoint.ToString()));
      return nullptr;
    }
    transport::ChannelOptions o;
    o.endpoint = info.endpoint;
    o.credentials.secret = cluster_->options().secret;
    o.credentials.client_id = cluster_->client_id();
    o.credentials.client_name = "farptr-parity-offload";
    o.connect_timeout = op_timeout_;
    o.op_timeout = op_timeout_;
    auto c = transport::TcpConnection::Connect(o);
    if (!c) {
      *error = c.error();
      return nullptr;
    }
    conn = std::make_unique<transport::TcpConnection>(std::move(*c));
  }
  return conn.get();
}

Result<SpanSet*> RemoteStore::WriteSetOffloaded(IoContext& io, std::span<const uint8_t* const> data,
                                                std::span<Span* const> spans,
                                                Status* offload_error) {
  *offload_error = Status::Ok();
  const int k = res_.k;
  const int r = res_.r;
  const size_t span = span_size_;
  if (res_.mode != SpanResilience::Mode::kErasure || r == 0) return WriteSet(io, data, spans);
  if (data.empty() || data.size() > static_cast<size_t>(k) || spans.size() != data.size()) {
    return Err(Internal(fmt::format("WriteSetOffloaded with {} spans (k = {})", data.size(), k)));
  }
  auto fall_back = [&](SpanSet* set, Status why) -> Result<SpanSet*> {
    if (set != nullptr) {
      std::lock_guard lock(mu_);
      FreeRowLocked(set);
    }
    spdlog::debug("far memory: parity offload failed, writing the set with client parity: {}",
                  why.ToString());
    *offload_error = std::move(why);
    return WriteSet(io, data, spans);
  };
  const uint8_t* cells[kMaxSetWidth];
  uint32_t live = 0;
  for (int m = 0; m < k; ++m) {
    const uint8_t* d =
        static_cast<size_t>(m) < data.size() ? data[static_cast<size_t>(m)] : nullptr;
    cells[m] = d != nullptr ? d : zeros_.data();
    if (d != nullptr) live |= 1u << m;
  }
  FARMEM_ASSIGN_OR_RETURN(SpanSet * set, ReserveRow());
  std::vector<client::Lease> members;
  uint64_t epoch = 0;
  {
    std::lock_guard lock(mu_);
    members = set->group->members;
    epoch = set->group->epoch;
  }
  const uint64_t off = static_cast<uint64_t>(set->row) * span;

  // 1. The k data cells, as WriteSet writes them.
  transport::Op ops[kMaxSetWidth];
  client::NodeId nodes[kMaxSetWidth];
  Status results[kMaxSetWidth];
  for (int m = 0; m < k; ++m) {
    ops[m] = {transport::OpType::kWrite,
              members[static_cast<size_t>(m)].slab(),
              off,
              const_cast<uint8_t*>(cells[m]),
              static_cast<uint32_t>(span),
              nullptr,
              0};
    nodes[m] = members[static_cast<size_t>(m)].node;
  }
  RunOps(io, {ops, static_cast<size_t>(k)}, {nodes, static_cast<size_t>(k)},
         {results, static_cast<size_t>(k)});
  for (int m = 0; m < k; ++m) {
    if (results[m].ok()) continue;
    cluster_->ReportFailure(nodes[m], results[m]);
    if (NodeGoneForOffload(results[m])) {
      MarkFailed(set->group, m, members[static_cast<size_t>(m)].id(), results[m]);
    }
    return fall_back(set, results[m].WithContext("writing a data cell"));
  }

  // 2. Each parity daemon computes its cell from the k data cells.
  wire::ParityEncodeRequest req;
  req.offset = off;
  req.length = static_cast<uint32_t>(span);
  req.k = static_cast<uint8_t>(k);
  req.r = static_cast<uint8_t>(r);
  // The daemon must answer before we give up on it: half our budget for its reads.
  req.timeout_ms = static_cast<uint32_t>(std::max<int64_t>(1, op_timeout_.count() / 2));
  for (int m = 0; m < k; ++m) {
    const Endpoint ep = cluster_->node(members[static_cast<size_t>(m)].node).endpoint;
    req.sources.push_back({ep.host, ep.port, members[static_cast<size_t>(m)].id(), off});
  }
  std::vector<uint8_t> body;
  for (int j = 0; j < r; ++j) {
    const client::Lease& target = members[static_cast<size_t>(k + j)];
    req.lease_id = target.id();
    req.parity_index = static_cast<uint8_t>(j);
    body.clear();
    wire::EncodeParityEncode(req, &body);
    Status err;
    transport::TcpConnection* conn = CallConnectionFor(io, target.node, &err);
    if (conn == nullptr) return fall_back(set, err.WithContext("parity offload"));
    io.offload_bytes_sent += wire::kHeaderSize + body.size();
    auto reply = conn->Call(wire::Opcode::kParityEncode, body, op_timeout_);
    io.offload_bytes_received += wire::kHeaderSize + (reply ? reply->size() : 0);
    if (!reply) {
      return fall_back(set, reply.error().WithContext(
                                fmt::format("PARITY_ENCODE of parity member {} on {}", j,
                                            cluster_->node(target.node).endpoint.ToString())));
    }
  }

  // 3. Commit, exactly as WriteSet does.
  {
    std::lock_guard lock(mu_);
    Group* g = set->group;
    if (g->failed_mask == 0 && g->lost_mask == 0 && !g->rebuilding && g->epoch == epoch) {
      set->writing = false;
      set->live_mask = live;
      for (size_t i = 0; i < spans.size(); ++i) {
        set->spans[i] = data[i] != nullptr ? spans[i] : nullptr;
      }
      return set;
    }
  }
  // A member failed while we wrote: re-protection did not see this row; place it elsewhere.
  return fall_back(set, Unavailable("a member of the slab group failed during the write"));
}

}  // namespace farmem::farptr_internal
