#include "peer_reader.h"

#include <fmt/format.h>

#include <algorithm>

#include "farmem/common/auth.h"

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
    o.credentials.identity = identity_;
    o.credentials.client_id = client_id_;
    o.credentials.client_name = client_name_;
    Result<transport::TcpConnection> c = Err(Internal("no secret to connect with"));
    for (const std::string& secret : secrets_) {  // a peer mid-rotation may know only one
      o.credentials.secret = secret.empty() ? secret : auth::ClientKey(secret, identity_);
      o.connect_timeout = Left(deadline);
      o.op_timeout = Left(deadline);
      c = transport::TcpConnection::Connect(o);
      if (c.has_value() || c.error().code() != StatusCode::kPermissionDenied) break;
    }
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
    uint8_t op[wire::kDataOpSize];
    wire::EncodeDataOp({cell.lease_id, cell.offset, length}, op);
    inflight_.push_back(*link);
    names_.push_back(conn.endpoint().ToString());
    Result<uint64_t> id = conn.Send(wire::Opcode::kRead, op, deadline);
    if (!id.has_value()) {
      Abandon();
      return id.error().WithContext("sending READ to " + names_.back());
    }
    ids_.push_back(*id);
  }
  return Status::Ok();
}

Status PeerReader::Finish(size_t i, uint8_t* dst, Deadline deadline) {
  if (i >= inflight_.size() || inflight_[i] == nullptr || inflight_[i]->conn == nullptr) {
    return Internal(fmt::format("PeerReader::Finish({}) without a request in flight", i));
  }
  Link& link = *inflight_[i];
  const std::string& name = names_[i];
  Result<transport::TcpConnection::Reply> r = link.conn->Receive(ids_[i], {dst, length_}, deadline);
  if (!r.has_value()) {
    return r.error().WithContext((link.conn->broken() ? "reading from " : "READ on ") + name);
  }
  if (!r->in_place) {
    link.conn.reset();  // it broke the protocol: not trusted with the next request
    return ProtocolError(
        fmt::format("{} answered a READ of {} bytes with {}", name, length_, r->body_len));
  }
  inflight_[i] = nullptr;
  return Status::Ok();
}

void PeerReader::Abandon() {
  for (Link* l : inflight_) {
    if (l != nullptr) l->conn.reset();
  }
  inflight_.clear();
}

}  // namespace farmem::daemon
