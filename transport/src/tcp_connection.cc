#include "farmem/transport/tcp_connection.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "farmem/common/auth.h"
#include "farmem/common/version.h"

namespace farmem::transport {

Result<TcpConnection> TcpConnection::Connect(const ChannelOptions& options) {
  TcpConnection c;
  c.endpoint_ = options.endpoint;
  FARMEM_ASSIGN_OR_RETURN(c.socket_,
                          ConnectTcp(options.endpoint, DeadlineIn(options.connect_timeout)));
  Status s = c.Handshake(options);
  if (!s.ok()) return Err(s.WithContext(fmt::format("farmemd {}", options.endpoint.ToString())));
  return c;
}

Status TcpConnection::Handshake(const ChannelOptions& options) {
  const Credentials& cred = options.credentials;
  wire::HelloRequest hello;
  hello.client_id = cred.client_id;
  hello.client_name = cred.client_name;
  const std::string_view identity = auth::CanonicalIdentity(cred.identity);
  if (identity != auth::kClusterIdentity) {
    FARMEM_RETURN_IF_ERROR(auth::ValidateIdentity(identity));
    hello.identity = std::string(identity);
  }
  FARMEM_RETURN_IF_ERROR(auth::RandomBytes(hello.client_nonce));
  std::vector<uint8_t> body;
  wire::EncodeHello(hello, &body);
  FARMEM_ASSIGN_OR_RETURN(auto reply, Call(wire::Opcode::kHello, body, options.connect_timeout));
  FARMEM_ASSIGN_OR_RETURN(hello_, wire::DecodeHelloReply(reply));
  const bool required = hello_.features & wire::kFeatureAuthRequired;
  if (!required) {
    if (!cred.secret.empty()) {
      return PermissionDenied(
          "daemon does not require authentication but this client has a secret: refusing to "
          "trust a daemon that cannot prove it knows the secret (start farmemd with "
          "--secret-file, or drop the client's secret)");
    }
    return Status::Ok();
  }
  if (cred.secret.empty()) {
    return PermissionDenied(
        "daemon requires authentication: give this client the shared secret "
        "(--secret-file)");
  }
  wire::AuthRequest auth_req;
  auth_req.client_mac = auth::ClientProof(cred.secret, hello_.server_nonce, hello.client_nonce,
                                          cred.client_id, hello.identity);
  // Only a daemon that sends its version takes ours (older ones expect exactly the proof).
  if (hello_.features & wire::kFeatureVersion)
    auth_req.client_version = std::string(kVersionString);
  body.clear();
  wire::EncodeAuth(auth_req, &body);
  FARMEM_ASSIGN_OR_RETURN(reply, Call(wire::Opcode::kAuth, body, options.connect_timeout));
  FARMEM_ASSIGN_OR_RETURN(auto auth_reply, wire::DecodeAuthReply(reply));
  const wire::Mac expected = auth::ServerProof(cred.secret, hello_.server_nonce, hello.client_nonce,
                                               cred.client_id, hello.identity);
  if (!auth::MacEqual(expected, auth_reply.server_mac)) {
    return PermissionDenied(hello.identity.empty()
                                ? "daemon failed to prove it knows the shared secret"
                                : "daemon failed to prove it knows the cluster secret (it could "
                                  "not derive this identity's key)");
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> TcpConnection::Call(wire::Opcode op, std::span<const uint8_t> body,
                                                 std::chrono::milliseconds timeout) {
  const Deadline deadline = DeadlineIn(timeout);
  auto context = [&](const Status& s) {
    return s.WithContext(
        fmt::format("{} to {}", wire::OpcodeName(static_cast<uint8_t>(op)), endpoint_.ToString()));
  };
  Result<uint64_t> id = Send(op, body, deadline);
  if (!id.has_value()) return Err(context(id.error()));
  Result<Reply> r = Receive(*id, {}, deadline);
  if (!r.has_value()) return Err(broken_ ? context(r.error()) : r.error());
  std::vector<uint8_t> reply(r->body_len);
  if (!r->in_place) {
    if (Status s = ReadBody(reply); !s.ok()) {
      return Err(s.WithContext(fmt::format("reply from {}", endpoint_.ToString())));
    }
  }
  return reply;
}

Result<uint64_t> TcpConnection::Send(wire::Opcode op, std::span<const uint8_t> body,
                                     Deadline deadline) {
  const iovec iov{const_cast<uint8_t*>(body.data()), body.size()};
  return SendV(op, {&iov, body.empty() ? 0u : 1u}, deadline);
}

Result<uint64_t> TcpConnection::SendV(wire::Opcode op, std::span<const iovec> body,
                                      Deadline deadline) {
  if (broken_) {
    return Err(Unavailable(fmt::format("connection to {} is broken", endpoint_.ToString())));
  }
  uint64_t len = 0;
  for (const iovec& v : body) len += v.iov_len;
  if (len > wire::kMaxBodyLen) {
    return Err(InvalidArgument(fmt::format("a {}-byte {} body exceeds the {}-byte frame limit", len,
                                           wire::OpcodeName(static_cast<uint8_t>(op)),
                                           wire::kMaxBodyLen)));
  }
  wire::FrameHeader h;
  h.opcode = static_cast<uint8_t>(op);
  h.request_id = ++next_request_id_;
  h.body_len = static_cast<uint32_t>(len);
  wire::EncodeHeader(h, send_header_);
  if (outstanding_.capacity() < kReservedOutstanding) {
    // Once, at the connection's first request (its handshake): the data path's requests then
    // allocate nothing (farmem-nbd's swap safety, docs/nbd.md).
    outstanding_.reserve(kReservedOutstanding);
    iov_.reserve(wire::kMaxOpsPerBatch + 2);
  }
  iov_.clear();
  iov_.push_back({send_header_, wire::kHeaderSize});
  for (const iovec& v : body) {
    if (v.iov_len > 0) iov_.push_back(v);
  }
  if (Status s = SendAll(socket_.fd(), iov_.data(), static_cast<int>(iov_.size()), deadline);
      !s.ok()) {
    return Err(Fail(std::move(s)));
  }
  outstanding_.push_back({h.request_id, h.opcode, false, 0, {}});
  return h.request_id;
}

Result<TcpConnection::Reply> TcpConnection::Receive(uint64_t id, std::span<uint8_t> dst,
                                                    Deadline deadline) {
  const iovec iov{dst.data(), dst.size()};
  return ReceiveV(id, {&iov, dst.empty() ? 0u : 1u}, deadline);
}

Result<TcpConnection::Reply> TcpConnection::ReceiveV(uint64_t id, std::span<const iovec> dst,
                                                     Deadline deadline) {
  if (broken_) {
    return Err(Unavailable(fmt::format("connection to {} is broken", endpoint_.ToString())));
  }
  FARMEM_RETURN_IF_ERROR(DropBody());
  auto it = Find(id);
  if (it == outstanding_.end()) {
    return Err(Internal(fmt::format("no request {} is outstanding on the connection to {}", id,
                                    endpoint_.ToString())));
  }
  if (it->arrived) return TakeArrived(it, dst);
  uint64_t dst_len = 0;
  for (const iovec& v : dst) dst_len += v.iov_len;
  body_deadline_ = deadline;
  for (;;) {
    uint8_t hdr[wire::kHeaderSize];
    if (!buffered()) {
      FARMEM_ASSIGN_OR_RETURN(const bool done,
                              ReceiveExpected(id, it->opcode, dst, dst_len, hdr, deadline));
      if (done) return Reply{static_cast<uint32_t>(dst_len), true};
    } else {
      FARMEM_RETURN_IF_ERROR(RecvStream(hdr, deadline));
    }
    Result<wire::FrameHeader> hr = wire::DecodeHeader(hdr);
    if (!hr.has_value()) return Err(Fail(hr.error()));
    const wire::FrameHeader& h = *hr;
    if (h.flags & wire::kFlagPush) {
      if (h.body_len > wire::kMaxControlBodyLen) {
        return Err(Fail(ProtocolError(fmt::format("{} pushed a {}-byte {}", endpoint_.ToString(),
                                                  h.body_len, wire::OpcodeName(h.opcode)))));
      }
      std::vector<uint8_t> body(h.body_len);
      FARMEM_RETURN_IF_ERROR(RecvStream(body, deadline));
      if (h.opcode == static_cast<uint8_t>(wire::Opcode::kEvictNotice)) {
        if (pushes_.size() == kMaxKeptPushes) pushes_.erase(pushes_.begin());
        pushes_.push_back(std::move(body));
      }
      continue;
    }
    auto match = h.is_reply() ? Find(h.request_id) : outstanding_.end();
    if (match == outstanding_.end() || match->arrived || match->opcode != h.opcode) {
      return Err(Fail(ProtocolError(fmt::format(
          "{} sent an unexpected frame ({} id {}) while waiting for the reply to {} id {}",
          endpoint_.ToString(), wire::OpcodeName(h.opcode), h.request_id,
          wire::OpcodeName(it->opcode), id))));
    }
    const uint32_t limit = h.status != 0 ? wire::kMaxErrorMessage : MaxReplyBody(h.opcode);
    if (h.body_len > limit) {
      return Err(Fail(ProtocolError(fmt::format("{} answered {} with {} bytes (at most {})",
                                                endpoint_.ToString(), wire::OpcodeName(h.opcode),
                                                h.body_len, limit))));
    }
    if (match != it) {  // ahead of its turn: keep it for its own Receive
      match->body.resize(h.body_len);
      FARMEM_RETURN_IF_ERROR(RecvStream(match->body, deadline));
      match->arrived = true;
      match->status = h.status;
      continue;
    }
    outstanding_.erase(it);
    if (h.status != 0) {
      std::vector<uint8_t> msg(h.body_len);
      FARMEM_RETURN_IF_ERROR(RecvStream(msg, deadline));
      return Err(wire::DecodeError(h.status, msg));
    }
    if (h.body_len == dst_len) {
      iov_.assign(dst.begin(), dst.end());
      FARMEM_RETURN_IF_ERROR(RecvStream(iov_.data(), static_cast<int>(iov_.size()), deadline));
      return Reply{h.body_len, true};
    }
    body_left_ = h.body_len;
    body_from_taken_ = false;
    return Reply{h.body_len, false};
  }
}

Result<TcpConnection::Reply> TcpConnection::TakeArrived(std::vector<Outstanding>::iterator it,
                                                        std::span<const iovec> dst) {
  Outstanding o = std::move(*it);
  outstanding_.erase(it);
  if (o.status != 0) return Err(wire::DecodeError(o.status, o.body));
  const uint32_t len = static_cast<uint32_t>(o.body.size());
  uint64_t dst_len = 0;
  for (const iovec& v : dst) dst_len += v.iov_len;
  if (len == dst_len) {
    size_t at = 0;
    for (const iovec& v : dst) {
      if (v.iov_len > 0) std::memcpy(v.iov_base, o.body.data() + at, v.iov_len);
      at += v.iov_len;
    }
    return Reply{len, true};
  }
  taken_ = std::move(o.body);
  taken_pos_ = 0;
  body_from_taken_ = true;
  body_left_ = len;
  return Reply{len, false};
}

Result<bool> TcpConnection::ReceiveExpected(uint64_t id, uint8_t opcode, std::span<const iovec> dst,
                                            uint64_t dst_len, uint8_t* hdr, Deadline deadline) {
  iov_.clear();
  iov_.push_back({hdr, wire::kHeaderSize});
  iov_.insert(iov_.end(), dst.begin(), dst.end());
  const uint64_t total = wire::kHeaderSize + dst_len;
  Result<size_t> n = RecvSome(socket_.fd(), iov_.data(), static_cast<int>(iov_.size()), deadline);
  if (!n.has_value()) return Err(Fail(n.error()));
  size_t got = *n;
  if (got < wire::kHeaderSize) {
    if (Status s = RecvExact(socket_.fd(), {hdr + got, wire::kHeaderSize - got}, deadline);
        !s.ok()) {
      return Err(Fail(std::move(s)));
    }
    got = wire::kHeaderSize;
  }
  Result<wire::FrameHeader> h = wire::DecodeHeader({hdr, wire::kHeaderSize});
  const bool expected = h.has_value() && h->is_reply() && (h->flags & wire::kFlagPush) == 0 &&
                        h->request_id == id && h->opcode == opcode && h->status == 0 &&
                        h->body_len == dst_len;
  if (!expected) {
    // Keep what followed the header for the piece-by-piece path.
    carry_.clear();
    carry_pos_ = 0;
    size_t left = got - wire::kHeaderSize;
    for (size_t i = 1; i < iov_.size() && left > 0; ++i) {
      const auto* b = static_cast<const uint8_t*>(iov_[i].iov_base);
      const size_t c = std::min(left, iov_[i].iov_len);
      carry_.insert(carry_.end(), b, b + c);
      left -= c;
    }
    return false;
  }
  if (got < total) {
    // Skip what arrived, receive the rest in place.
    iovec* rest = iov_.data();
    int rest_n = static_cast<int>(iov_.size());
    AdvanceIov(rest, rest_n, got);
    if (Status s = RecvExactV(socket_.fd(), rest, rest_n, deadline); !s.ok()) {
      return Err(Fail(std::move(s)));
    }
  }
  outstanding_.erase(Find(id));
  return true;
}

Status TcpConnection::ReadBody(std::span<uint8_t> out) {
  iovec iov{out.data(), out.size()};
  return ReadBodyV(&iov, 1);
}

Status TcpConnection::ReadBodyV(iovec* iov, int iovcnt) {
  uint64_t len = 0;
  for (int i = 0; i < iovcnt; ++i) len += iov[i].iov_len;
  if (len > body_left_) {
    return Internal(fmt::format("reading {} bytes of a reply body with {} left", len, body_left_));
  }
  body_left_ -= static_cast<uint32_t>(len);
  if (!body_from_taken_) return RecvStream(iov, iovcnt, body_deadline_);
  for (int i = 0; i < iovcnt; ++i) {
    if (iov[i].iov_len > 0)
      std::memcpy(iov[i].iov_base, taken_.data() + taken_pos_, iov[i].iov_len);
    taken_pos_ += iov[i].iov_len;
  }
  return Status::Ok();
}

Status TcpConnection::DropBody() {
  if (body_from_taken_) {
    taken_.clear();
    body_from_taken_ = false;
    body_left_ = 0;
  }
  while (body_left_ > 0) {
    scratch_.resize(std::min<size_t>(body_left_, 64 << 10));
    FARMEM_RETURN_IF_ERROR(ReadBody(scratch_));
  }
  return Status::Ok();
}

Status TcpConnection::RecvStream(std::span<uint8_t> out, Deadline deadline) {
  iovec iov{out.data(), out.size()};
  return RecvStream(&iov, 1, deadline);
}

Status TcpConnection::RecvStream(iovec* iov, int n, Deadline deadline) {
  while (n > 0 && carry_pos_ < carry_.size()) {
    if (iov->iov_len == 0) {
      ++iov;
      --n;
      continue;
    }
    const size_t c = std::min(iov->iov_len, carry_.size() - carry_pos_);
    std::memcpy(iov->iov_base, carry_.data() + carry_pos_, c);
    carry_pos_ += c;
    iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + c;
    iov->iov_len -= c;
  }
  if (carry_pos_ == carry_.size()) {
    carry_.clear();
    carry_pos_ = 0;
  }
  if (n == 0) return Status::Ok();
  if (Status s = RecvExactV(socket_.fd(), iov, n, deadline); !s.ok()) return Fail(std::move(s));
  return Status::Ok();
}

std::optional<uint64_t> TcpConnection::ArrivedReply() const {
  for (const Outstanding& o : outstanding_) {
    if (o.arrived) return o.id;
  }
  return std::nullopt;
}

bool TcpConnection::ReplyWaiting() const {
  if (broken_ || buffered() || ArrivedReply().has_value()) return true;
  uint8_t probe;
  // recv() returning 0 (the daemon closed) leaves errno alone: only < 0 may look at it.
  const ssize_t r = ::recv(socket_.fd(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
  return !(r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
}

Status TcpConnection::SetReceiveTimeout(std::chrono::milliseconds timeout) {
  if (timeout == rcv_timeout_) return Status::Ok();
  FARMEM_RETURN_IF_ERROR(farmem::SetReceiveTimeout(socket_.fd(), timeout));
  rcv_timeout_ = timeout;
  return Status::Ok();
}

Status TcpConnection::Fail(Status why) {
  broken_ = true;
  return why;
}

std::vector<TcpConnection::Outstanding>::iterator TcpConnection::Find(uint64_t id) {
  auto it = outstanding_.begin();
  while (it != outstanding_.end() && it->id != id) ++it;
  return it;
}

uint32_t TcpConnection::MaxReplyBody(uint8_t opcode) {
  return opcode == static_cast<uint8_t>(wire::Opcode::kRead) ||
                 opcode == static_cast<uint8_t>(wire::Opcode::kBatch)
             ? wire::kMaxBodyLen
             : wire::kMaxControlBodyLen;
}

std::vector<std::vector<uint8_t>> TcpConnection::TakePushes() {
  std::vector<std::vector<uint8_t>> out;
  out.swap(pushes_);
  return out;
}

}  // namespace farmem::transport
