// RawClient: a farmem peer that speaks the wire protocol byte by byte, for tests that must send
// what no well-behaved client would (cut frames, wrong magic, lying lengths, other clients'
// leases) and check exactly what the daemon answers.
//
// Header-only; link farmem::test_support and #include "support/raw_client.h".
//
//   auto c = RawClient::Connect(daemon.endpoint());
//   ASSERT_TRUE(c->Hello(RandomClientId(), secret).ok());
//   c->SendRaw({.magic = 0x12345678, .opcode = 3});
//   auto reply = c->Receive();           // one frame, or an error if none came in time
//   EXPECT_TRUE(c->WaitClosed());        // the daemon hung up
//
// Every receive has a deadline, so a daemon that stays silent fails a test instead of hanging it.
// A RawClient belongs to one thread.
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/auth.h"
#include "farmem/common/config.h"
#include "farmem/common/socket.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::testing {

inline constexpr std::chrono::milliseconds kRawTimeout{3000};

// A header with every field settable, including the ones wire::EncodeHeader fixes.
struct RawHeader {
  uint32_t magic = wire::kMagic;
  uint8_t version = wire::kVersion;
  uint8_t opcode = 0;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t body_len = 0;
  uint16_t status = 0;
  uint16_t reserved = 0;
};

// Written out field by field on purpose, the same shape as wire::EncodeHeader: that one fixes
// the magic and the reserved field, and these tests must be able to get them wrong.
inline std::vector<uint8_t> EncodeRawHeader(const RawHeader& h) {
  std::vector<uint8_t> out;
  wire::Writer w(&out);
  w.U32(h.magic);
  w.U8(h.version);
  w.U8(h.opcode);
  w.U16(h.flags);
  w.U64(h.request_id);
  w.U32(h.body_len);
  w.U16(h.status);
  w.U16(h.reserved);
  return out;
}

inline wire::ClientId RandomClientId() {
  wire::ClientId id{};
  std::random_device rd;
  for (uint8_t& b : id) b = static_cast<uint8_t>(rd());
  id[0] |= 1;  // never the all-zero id
  return id;
}

// Bodies of the data opcodes, built by hand so any field may be out of range.
inline std::vector<uint8_t> DataOpBody(uint64_t lease_id, uint64_t offset, uint32_t length,
                                       uint32_t reserved = 0) {
  std::vector<uint8_t> out;
  wire::Writer w(&out);
  w.U64(lease_id);
  w.U64(offset);
  w.U32(length);
  w.U32(reserved);
  return out;
}

struct RawBatchOp {
  uint8_t op = static_cast<uint8_t>(wire::Opcode::kRead);
  uint32_t length = 0;
  uint64_t lease_id = 0;
  uint64_t offset = 0;
};

// count, reserved, descriptors; the caller appends write payloads.
inline std::vector<uint8_t> BatchTable(std::span<const RawBatchOp> ops, uint32_t count) {
  std::vector<uint8_t> out;
  wire::Writer w(&out);
  w.U32(count);
  w.U32(0);
  for (const RawBatchOp& op : ops) {
    w.U8(op.op);
    w.Zeros(3);
    w.U32(op.length);
    w.U64(op.lease_id);
    w.U64(op.offset);
  }
  return out;
}

struct RawFrame {
  wire::FrameHeader header;
  std::vector<uint8_t> body;

  StatusCode code() const { return StatusCodeFromWire(header.status); }
  // OK, or the error the frame carries (with the daemon's message).
  Status status() const {
    return header.status == 0 ? Status::Ok() : wire::DecodeError(header.status, body);
  }
};

// One whole frame from `fd` (header checked with wire::DecodeHeader, then its body): what
// RawClient::Receive reads, and what the tests' stand-in daemons read from their clients.
inline Result<RawFrame> RecvFrame(int fd, Deadline deadline) {
  uint8_t hdr[wire::kHeaderSize];
  FARMEM_RETURN_IF_ERROR(RecvExact(fd, hdr, deadline));
  FARMEM_ASSIGN_OR_RETURN(wire::FrameHeader h, wire::DecodeHeader(hdr));
  RawFrame f{h, std::vector<uint8_t>(h.body_len)};
  FARMEM_RETURN_IF_ERROR(RecvExact(fd, f.body, deadline));
  return f;
}

// A stand-in daemon's reply to `request`: its opcode and id, the reply flag, `body`.
inline Status SendReply(int fd, const wire::FrameHeader& request, std::span<const uint8_t> body,
                        Deadline deadline) {
  wire::FrameHeader h = request;
  h.flags = wire::kFlagReply;
  h.body_len = static_cast<uint32_t>(body.size());
  std::vector<uint8_t> out(wire::kHeaderSize);
  wire::EncodeHeader(h, out.data());
  out.insert(out.end(), body.begin(), body.end());
  return SendAll(fd, out, deadline);
}

class RawClient {
 public:
  static Result<RawClient> Connect(const Endpoint& ep,
                                   std::chrono::milliseconds timeout = kRawTimeout) {
    FARMEM_ASSIGN_OR_RETURN(Socket s, ConnectTcp(ep, DeadlineIn(timeout)));
    RawClient c;
    c.socket_ = std::move(s);
    return c;
  }

  int fd() const { return socket_.fd(); }
  uint64_t NextId() { return ++next_id_; }
  const wire::HelloReply& hello() const { return hello_; }
  const wire::Nonce& client_nonce() const { return client_nonce_; }
  const wire::ClientId& client_id() const { return client_id_; }

  Status Send(std::span<const uint8_t> bytes) {
    return SendAll(socket_.fd(), bytes, DeadlineIn(kRawTimeout));
  }
  Status SendRaw(const RawHeader& h, std::span<const uint8_t> body = {}) {
    std::vector<uint8_t> bytes = EncodeRawHeader(h);
    bytes.insert(bytes.end(), body.begin(), body.end());
    return Send(bytes);
  }
  // A well-formed request frame; body_len is the body's size. Returns the request id used.
  Result<uint64_t> SendFrame(wire::Opcode op, std::span<const uint8_t> body = {}) {
    const uint64_t id = NextId();
    FARMEM_RETURN_IF_ERROR(SendRaw({.opcode = static_cast<uint8_t>(op),
                                    .request_id = id,
                                    .body_len = static_cast<uint32_t>(body.size())},
                                   body));
    return id;
  }

  // Receives one whole frame (header checked with wire::DecodeHeader, then its body).
  Result<RawFrame> Receive(std::chrono::milliseconds timeout = kRawTimeout) {
    return RecvFrame(socket_.fd(), DeadlineIn(timeout));
  }

  // Sends a well-formed request and receives the next frame, which must be its reply.
  Result<RawFrame> Call(wire::Opcode op, std::span<const uint8_t> body = {},
                        std::chrono::milliseconds timeout = kRawTimeout) {
    FARMEM_ASSIGN_OR_RETURN(uint64_t id, SendFrame(op, body));
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Receive(timeout));
    if (!f.header.is_reply() || f.header.request_id != id ||
        f.header.opcode != static_cast<uint8_t>(op)) {
      return Err(ProtocolError("reply does not match the request (opcode " +
                               std::to_string(f.header.opcode) + ", id " +
                               std::to_string(f.header.request_id) + ")"));
    }
    return f;
  }

  // True if the daemon closes the connection within `timeout`. Frames still arriving are read
  // and dropped; use Receive() first to check them.
  bool WaitClosed(std::chrono::milliseconds timeout = kRawTimeout) {
    const Deadline deadline = DeadlineIn(timeout);
    uint8_t buf[4096];
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{socket_.fd(), POLLIN, 0};
      const int n = ::poll(&p, 1, static_cast<int>(left.count()));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      const ssize_t r = ::recv(socket_.fd(), buf, sizeof(buf), MSG_DONTWAIT);
      if (r == 0) return true;
      if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
    }
  }

  // True if nothing arrives (and the connection stays open) for `quiet`.
  bool Silent(std::chrono::milliseconds quiet) {
    pollfd p{socket_.fd(), POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(quiet.count())) == 0;
  }

  // HELLO, then AUTH when the daemon asks for it and a secret is given. Checks the daemon's proof.
  Status Hello(const wire::ClientId& id, std::string_view secret = {}) {
    client_id_ = id;
    wire::HelloRequest req;
    req.client_id = id;
    req.client_name = "raw_client";
    FARMEM_RETURN_IF_ERROR(auth::RandomBytes(req.client_nonce));
    client_nonce_ = req.client_nonce;
    std::vector<uint8_t> body;
    wire::EncodeHello(req, &body);
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kHello, body));
    FARMEM_RETURN_IF_ERROR(f.status());
    FARMEM_ASSIGN_OR_RETURN(hello_, wire::DecodeHelloReply(f.body));
    if (!(hello_.features & wire::kFeatureAuthRequired) || secret.empty()) return Status::Ok();
    return Auth(auth::ClientProof(secret, hello_.server_nonce, client_nonce_, client_id_), secret);
  }

  // Sends AUTH with the given proof; when `secret` is given, checks the daemon's proof too.
  Status Auth(const wire::Mac& proof, std::string_view secret = {}) {
    std::vector<uint8_t> body;
    wire::EncodeAuth({.client_mac = proof, .client_version = {}}, &body);
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kAuth, body));
    FARMEM_RETURN_IF_ERROR(f.status());
    FARMEM_ASSIGN_OR_RETURN(wire::AuthReply reply, wire::DecodeAuthReply(f.body));
    if (!secret.empty() &&
        !auth::MacEqual(reply.server_mac, auth::ServerProof(secret, hello_.server_nonce,
                                                            client_nonce_, client_id_))) {
      return PermissionDenied("daemon's AUTH proof is wrong");
    }
    return Status::Ok();
  }

  Result<wire::StatReply> Stat() {
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kStat));
    FARMEM_RETURN_IF_ERROR(f.status());
    return wire::DecodeStatReply(f.body);
  }

  Result<std::vector<wire::LeaseGrant>> Alloc(uint32_t count) {
    std::vector<uint8_t> body;
    wire::EncodeAlloc({count}, &body);
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kAlloc, body));
    FARMEM_RETURN_IF_ERROR(f.status());
    FARMEM_ASSIGN_OR_RETURN(wire::AllocReply reply, wire::DecodeAllocReply(f.body));
    return std::move(reply.leases);
  }

  Status Free(std::vector<uint64_t> lease_ids) {
    std::vector<uint8_t> body;
    wire::EncodeFree({std::move(lease_ids)}, &body);
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kFree, body));
    return f.status();
  }

  Status Write(uint64_t lease_id, uint64_t offset, std::span<const uint8_t> data) {
    std::vector<uint8_t> body = DataOpBody(lease_id, offset, static_cast<uint32_t>(data.size()));
    body.insert(body.end(), data.begin(), data.end());
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kWrite, body));
    FARMEM_RETURN_IF_ERROR(f.status());
    if (!f.body.empty()) return ProtocolError("WRITE reply has a body");
    return Status::Ok();
  }

  Result<std::vector<uint8_t>> Read(uint64_t lease_id, uint64_t offset, uint32_t length) {
    const std::vector<uint8_t> body = DataOpBody(lease_id, offset, length);
    FARMEM_ASSIGN_OR_RETURN(RawFrame f, Call(wire::Opcode::kRead, body));
    FARMEM_RETURN_IF_ERROR(f.status());
    if (f.body.size() != length) return Err(ProtocolError("READ reply of the wrong size"));
    return std::move(f.body);
  }

  void ShutdownWrite() { ::shutdown(socket_.fd(), SHUT_WR); }
  void Close() { socket_.Close(); }

 private:
  RawClient() = default;

  Socket socket_;
  uint64_t next_id_ = 0;
  wire::ClientId client_id_{};
  wire::Nonce client_nonce_{};
  wire::HelloReply hello_;
};

}  // namespace farmem::testing
