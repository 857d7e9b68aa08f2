#include "peer_reader.h"

#include <fmt/format.h>

#include <algorithm>

namespace farmem::daemon {

namespace {
std::chrono::milliseconds Left(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}
}  // namespace

Result<PeerReader::Link*> PeerReader::LinkFor(const wire::PeerCell& cell, Deadline deadline) {
  const Endpoint ep{cell.host, cell.port};
  const std::string name = ep.ToString();
  Link& link = links_[name];
  if (link.conn != nullptr && link.conn->broken()) link.conn.reset();
  if (link.conn == nullptr) {
    transport::ChannelOptions o;
    o.endpoint = ep;
    o.credentials.secret = secret_;
    o.credentials.client_id = client_id_;
    o.credentials.client_name = client_name_;
    o.connect_timeout = Left(deadline);
    o.op_timeout = Left(deadline);
    Result<transport::TcpConnection> c = transport::TcpConnection::Connect(o);
    if (!c.has_value()) {
      links_.erase(name);
      return Err(c.error().WithContext("connecting to " + name));
    }
    link.conn = std::make_unique<transport::TcpConnection>(std::move(*c));
  }
  return &link;
}

Status PeerReader::Start(std::span<const wire::PeerCell> cells, uint32_t length,
                         Deadline deadline) {
  inflight_.clear();
  ids_.clear();
  names_.clear();
  length_ = length;
  // A client names its own daemons, a handful; one that names ever new addresses must not pile
  // up connections here. Dropped only here, before this round holds pointers to any link.
  if (links_.size() + cells.size() > kMaxLinks) links_.clear();
  for (const wire::PeerCell& cell : cells) {
    Result<Link*> link = LinkFor(cell, deadline);
    if (!link.has_value()) {
      Abandon();
      return link.error();
    }
    transport::TcpConnection& conn = *(*link)->conn;
    wire::FrameHeader h;
    h.opcode = static_cast<uint8_t>(wire::Opcode::kRead);
    h.request_id = conn.NextRequestId();
    h.body_len = wire::kDataOpSize;
    uint8_t frame[wire::kHeaderSize + wire::kDataOpSize];
    wire::EncodeHeader(h, frame);
    wire::EncodeDataOp({cell.lease_id, cell.offset, length}, frame + wire::kHeaderSize);
    inflight_.push_back(*link);
    ids_.push_back(h.request_id);
    names_.push_back(conn.endpoint().ToString());
    if (Status s = SendAll(conn.socket().fd(), frame, deadline); !s.ok()) {
      conn.MarkBroken();
      Abandon();
      return s.WithContext("sending READ to " + names_.back());
    }
  }
  return Status::Ok();
}

Status PeerReader::Finish(size_t i, uint8_t* dst, Deadline deadline) {
  if (i >= inflight_.size() || inflight_[i] == nullptr || inflight_[i]->conn == nullptr) {
    return Internal(fmt::format("PeerReader::Finish({}) without a request in flight", i));
  }
  transport::TcpConnection& conn = *inflight_[i]->conn;
  const std::string& name = names_[i];
  for (;;) {
    uint8_t hdr[wire::kHeaderSize];
    Status s = RecvExact(conn.socket().fd(), hdr, deadline);
    if (!s.ok()) {
      conn.MarkBroken();
      return s.WithContext("reading from " + name);
    }
    Result<wire::FrameHeader> h = wire::DecodeHeader(hdr);
    if (!h.has_value()) {
      conn.MarkBroken();
      return h.error().WithContext("reply from " + name);
    }
    if (h->flags & wire::kFlagPush) {  // an EVICT_NOTICE meant for the client: not ours to act on
      std::vector<uint8_t> skip(h->body_len);
      if (s = RecvExact(conn.socket().fd(), skip, deadline); !s.ok()) {
        conn.MarkBroken();
        return s.WithContext("reading from " + name);
      }
      continue;
    }
    if (!h->is_reply() || h->request_id != ids_[i] ||
        h->opcode != static_cast<uint8_t>(wire::Opcode::kRead)) {
      conn.MarkBroken();
      return ProtocolError(fmt::format("{} answered {} id {} where the READ id {} reply was due",
                                       name, wire::OpcodeName(h->opcode), h->request_id, ids_[i]));
    }
    if (h->status != 0) {
      std::vector<uint8_t> msg(h->body_len);
      if (s = RecvExact(conn.socket().fd(), msg, deadline); !s.ok()) {
        conn.MarkBroken();
        return s.WithContext("reading from " + name);
      }
      return wire::DecodeError(h->status, msg).WithContext("READ on " + name);
    }
    if (h->body_len != length_) {
      conn.MarkBroken();
      return ProtocolError(
          fmt::format("{} answered a READ of {} bytes with {}", name, length_, h->body_len));
    }
    s = RecvExact(conn.socket().fd(), {dst, length_}, deadline);
    if (!s.ok()) {
      conn.MarkBroken();
      return s.WithContext("reading from " + name);
    }
    inflight_[i] = nullptr;
    return Status::Ok();
  }
}

void PeerReader::Abandon() {
  for (Link* l : inflight_) {
    if (l != nullptr && l->conn != nullptr) l->conn->MarkBroken();
  }
  inflight_.clear();
}

}  // namespace farmem::daemon
