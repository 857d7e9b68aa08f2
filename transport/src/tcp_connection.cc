#include "farmem/transport/tcp_connection.h"

#include <fmt/format.h>

#include "farmem/common/auth.h"

namespace farmem::transport {

namespace {
Status SendFrame(int fd, wire::Opcode op, uint64_t request_id, std::span<const uint8_t> body,
                 Deadline deadline) {
  wire::FrameHeader h;
  h.opcode = static_cast<uint8_t>(op);
  h.request_id = request_id;
  h.body_len = static_cast<uint32_t>(body.size());
  uint8_t hdr[wire::kHeaderSize];
  wire::EncodeHeader(h, hdr);
  iovec iov[2] = {{hdr, sizeof(hdr)}, {const_cast<uint8_t*>(body.data()), body.size()}};
  return SendAll(fd, iov, body.empty() ? 1 : 2, deadline);
}
}  // namespace

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
  auth_req.client_mac =
      auth::ClientProof(cred.secret, hello_.server_nonce, hello.client_nonce, cred.client_id);
  body.clear();
  wire::EncodeAuth(auth_req, &body);
  FARMEM_ASSIGN_OR_RETURN(reply, Call(wire::Opcode::kAuth, body, options.connect_timeout));
  FARMEM_ASSIGN_OR_RETURN(auto auth_reply, wire::DecodeAuthReply(reply));
  const wire::Mac expected =
      auth::ServerProof(cred.secret, hello_.server_nonce, hello.client_nonce, cred.client_id);
  if (!auth::MacEqual(expected, auth_reply.server_mac)) {
    return PermissionDenied("daemon failed to prove it knows the shared secret");
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> TcpConnection::Call(wire::Opcode op, std::span<const uint8_t> body,
                                                 std::chrono::milliseconds timeout) {
  if (broken_)
    return Err(Unavailable(fmt::format("connection to {} is broken", endpoint_.ToString())));
  const Deadline deadline = DeadlineIn(timeout);
  const uint64_t id = NextRequestId();
  Status s = SendFrame(socket_.fd(), op, id, body, deadline);
  if (!s.ok()) {
    broken_ = true;
    return Err(s.WithContext(
        fmt::format("{} to {}", wire::OpcodeName(static_cast<uint8_t>(op)), endpoint_.ToString())));
  }
  for (;;) {
    uint8_t hdr[wire::kHeaderSize];
    s = RecvExact(socket_.fd(), hdr, deadline);
    Result<wire::FrameHeader> h = s.ok() ? wire::DecodeHeader(hdr, wire::kMaxControlBodyLen)
                                         : Result<wire::FrameHeader>(Err(s));
    if (!h.has_value()) {
      broken_ = true;
      return Err(h.error().WithContext(fmt::format(
          "{} to {}", wire::OpcodeName(static_cast<uint8_t>(op)), endpoint_.ToString())));
    }
    std::vector<uint8_t> reply(h->body_len);
    s = RecvExact(socket_.fd(), reply, deadline);
    if (!s.ok()) {
      broken_ = true;
      return Err(s.WithContext(fmt::format("reply from {}", endpoint_.ToString())));
    }
    if (h->flags & wire::kFlagPush) {
      if (h->opcode == static_cast<uint8_t>(wire::Opcode::kEvictNotice)) pushes_.push_back(reply);
      continue;
    }
    if (!h->is_reply() || h->request_id != id || h->opcode != static_cast<uint8_t>(op)) {
      broken_ = true;
      return Err(ProtocolError(fmt::format(
          "{} sent an unexpected frame ({} id {}) while waiting for the reply to {} id {}",
          endpoint_.ToString(), wire::OpcodeName(h->opcode), h->request_id,
          wire::OpcodeName(static_cast<uint8_t>(op)), id)));
    }
    if (h->status != 0) return Err(wire::DecodeError(h->status, reply));
    return reply;
  }
}

std::vector<std::vector<uint8_t>> TcpConnection::TakePushes() {
  std::vector<std::vector<uint8_t>> out;
  out.swap(pushes_);
  return out;
}

}  // namespace farmem::transport
