#include "nbd_test_client.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <random>

namespace farmem::blockdev::testing {

using namespace farmem::blockdev::nbd;  // NOLINT(build/namespaces): test code, protocol names

namespace {

void PutBe16(std::vector<uint8_t>* v, uint16_t x) {
  uint8_t b[2];
  StoreBe16(b, x);
  v->insert(v->end(), b, b + 2);
}
void PutBe32(std::vector<uint8_t>* v, uint32_t x) {
  uint8_t b[4];
  StoreBe32(b, x);
  v->insert(v->end(), b, b + 4);
}
void PutBe64(std::vector<uint8_t>* v, uint64_t x) {
  uint8_t b[8];
  StoreBe64(b, x);
  v->insert(v->end(), b, b + 8);
}

}  // namespace

Result<Socket> ConnectUnix(const std::string& path) {
  Socket s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return Err(ErrnoStatus(StatusCode::kIoError, "socket", errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return Err(InvalidArgument("path too long"));
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Err(ErrnoStatus(StatusCode::kUnavailable, "connect " + path, errno));
  }
  return s;
}

std::vector<uint8_t> OptionBytes(uint32_t option, std::span<const uint8_t> data) {
  std::vector<uint8_t> v;
  PutBe64(&v, kOptionMagic);
  PutBe32(&v, option);
  PutBe32(&v, static_cast<uint32_t>(data.size()));
  v.insert(v.end(), data.begin(), data.end());
  return v;
}

std::vector<uint8_t> GoData(std::string_view name, std::span<const uint16_t> infos) {
  std::vector<uint8_t> v;
  PutBe32(&v, static_cast<uint32_t>(name.size()));
  v.insert(v.end(), name.begin(), name.end());
  PutBe16(&v, static_cast<uint16_t>(infos.size()));
  for (uint16_t i : infos) PutBe16(&v, i);
  return v;
}

std::vector<uint8_t> RequestBytes(uint16_t type, uint16_t flags, uint64_t handle, uint64_t offset,
                                  uint32_t length) {
  std::vector<uint8_t> v;
  PutBe32(&v, kRequestMagic);
  PutBe16(&v, flags);
  PutBe16(&v, type);
  PutBe64(&v, handle);
  PutBe64(&v, offset);
  PutBe32(&v, length);
  return v;
}

Result<OptionReply> ReadOptionReply(int fd, std::chrono::milliseconds timeout) {
  uint8_t h[kOptionReplyHeaderSize];
  FARMEM_RETURN_IF_ERROR(RecvExact(fd, h, DeadlineIn(timeout)));
  if (LoadBe64(h) != kOptionReplyMagic) return Err(ProtocolError("bad option reply magic"));
  OptionReply r;
  r.option = LoadBe32(h + 8);
  r.type = LoadBe32(h + 12);
  const uint32_t len = LoadBe32(h + 16);
  if (len > (1u << 20)) return Err(ProtocolError("option reply too long"));
  r.data.resize(len);
  if (len > 0) FARMEM_RETURN_IF_ERROR(RecvExact(fd, r.data, DeadlineIn(timeout)));
  return r;
}

std::vector<uint8_t> Pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

Result<NbdTestClient> NbdTestClient::Connect(const std::string& unix_path,
                                             const ClientOptions& options) {
  FARMEM_ASSIGN_OR_RETURN(Socket s, ConnectUnix(unix_path));
  return Handshake(std::move(s), options);
}

Result<NbdTestClient> NbdTestClient::Handshake(Socket socket, const ClientOptions& o) {
  NbdTestClient c(std::move(socket), o.timeout);
  const int fd = c.socket_.fd();
  uint8_t greeting[18];
  FARMEM_RETURN_IF_ERROR(RecvExact(fd, greeting, DeadlineIn(o.timeout)));
  if (LoadBe64(greeting) != kNbdMagic || LoadBe64(greeting + 8) != kOptionMagic) {
    return Err(ProtocolError("bad greeting"));
  }
  const uint16_t hflags = LoadBe16(greeting + 16);
  uint32_t cflags = 0;
  if (o.fixed_newstyle && (hflags & kFlagFixedNewstyle)) cflags |= kClientFlagFixedNewstyle;
  if (o.no_zeroes && (hflags & kFlagNoZeroes)) cflags |= kClientFlagNoZeroes;
  uint8_t cf[4];
  StoreBe32(cf, cflags);
  FARMEM_RETURN_IF_ERROR(SendAll(fd, cf, DeadlineIn(o.timeout)));

  if (o.structured_replies) {
    FARMEM_RETURN_IF_ERROR(
        SendAll(fd, OptionBytes(kOptStructuredReply, {}), DeadlineIn(o.timeout)));
    FARMEM_ASSIGN_OR_RETURN(OptionReply r, ReadOptionReply(fd, o.timeout));
    c.structured_ = r.type == kRepAck;
  }
  if (o.use_go) {
    const uint16_t infos[] = {kInfoBlockSize};
    FARMEM_RETURN_IF_ERROR(
        SendAll(fd, OptionBytes(kOptGo, GoData(o.export_name, infos)), DeadlineIn(o.timeout)));
    bool got_export = false;
    for (;;) {
      FARMEM_ASSIGN_OR_RETURN(OptionReply r, ReadOptionReply(fd, o.timeout));
      if (r.type == kRepAck) break;
      if (r.type & 0x80000000u) {
        return Err(Unavailable(fmt::format("NBD_OPT_GO refused: 0x{:x} {}", r.type,
                                           std::string(r.data.begin(), r.data.end()))));
      }
      if (r.type == kRepInfo && r.data.size() >= 2 && LoadBe16(r.data.data()) == kInfoExport &&
          r.data.size() == 12) {
        c.size_ = LoadBe64(r.data.data() + 2);
        c.flags_ = LoadBe16(r.data.data() + 10);
        got_export = true;
      }
    }
    if (!got_export) return Err(ProtocolError("NBD_OPT_GO succeeded without NBD_INFO_EXPORT"));
  } else {
    std::span<const uint8_t> name(reinterpret_cast<const uint8_t*>(o.export_name.data()),
                                  o.export_name.size());
    FARMEM_RETURN_IF_ERROR(SendAll(fd, OptionBytes(kOptExportName, name), DeadlineIn(o.timeout)));
    std::vector<uint8_t> r((cflags & kClientFlagNoZeroes) ? 10 : 134);
    FARMEM_RETURN_IF_ERROR(RecvExact(fd, r, DeadlineIn(o.timeout)));
    c.size_ = LoadBe64(r.data());
    c.flags_ = LoadBe16(r.data() + 8);
  }
  return c;
}

Status NbdTestClient::Send(uint16_t type, uint16_t flags, uint64_t handle, uint64_t offset,
                           uint32_t length, std::span<const uint8_t> payload) {
  std::vector<uint8_t> msg = RequestBytes(type, flags, handle, offset, length);
  msg.insert(msg.end(), payload.begin(), payload.end());
  in_flight_[handle] = Sent{type, offset, length};
  return SendAll(socket_.fd(), msg, DeadlineIn(timeout_));
}

Result<NbdReply> NbdTestClient::Receive() {
  const int fd = socket_.fd();
  uint8_t magic[4];
  FARMEM_RETURN_IF_ERROR(RecvExact(fd, magic, DeadlineIn(timeout_)));
  NbdReply reply;
  if (LoadBe32(magic) == kSimpleReplyMagic) {
    uint8_t rest[12];
    FARMEM_RETURN_IF_ERROR(RecvExact(fd, rest, DeadlineIn(timeout_)));
    reply.error = LoadBe32(rest);
    reply.handle = LoadBe64(rest + 4);
    auto it = in_flight_.find(reply.handle);
    if (it == in_flight_.end()) return Err(ProtocolError("simple reply for an unknown handle"));
    if (it->second.type == kCmdRead && reply.error == 0) {
      if (structured_) return Err(ProtocolError("simple reply to a READ with structured replies"));
      reply.data.resize(it->second.length);
      FARMEM_RETURN_IF_ERROR(RecvExact(fd, reply.data, DeadlineIn(timeout_)));
    }
    in_flight_.erase(it);
    return reply;
  }
  if (LoadBe32(magic) != kStructuredReplyMagic) return Err(ProtocolError("bad reply magic"));
  if (!structured_) return Err(ProtocolError("structured reply that was not negotiated"));
  reply.structured = true;
  bool first = true;
  for (;;) {
    uint8_t h[16];
    if (!first) {
      FARMEM_RETURN_IF_ERROR(RecvExact(fd, magic, DeadlineIn(timeout_)));
      if (LoadBe32(magic) != kStructuredReplyMagic) return Err(ProtocolError("bad chunk magic"));
    }
    FARMEM_RETURN_IF_ERROR(RecvExact(fd, h, DeadlineIn(timeout_)));
    const uint16_t flags = LoadBe16(h);
    const uint16_t type = LoadBe16(h + 2);
    const uint64_t handle = LoadBe64(h + 4);
    const uint32_t len = LoadBe32(h + 12);
    if (!first && handle != reply.handle) {
      return Err(ProtocolError("chunks of two replies interleaved (not produced by farmem-nbd)"));
    }
    reply.handle = handle;
    first = false;
    ++reply.chunks;
    auto it = in_flight_.find(handle);
    if (it == in_flight_.end()) return Err(ProtocolError("structured reply for unknown handle"));
    if (len > kMaxPayload + 64) return Err(ProtocolError("chunk too long"));
    std::vector<uint8_t> payload(len);
    if (len > 0) FARMEM_RETURN_IF_ERROR(RecvExact(fd, payload, DeadlineIn(timeout_)));
    if (type == kReplyTypeOffsetData) {
      if (len < 9) return Err(ProtocolError("OFFSET_DATA chunk shorter than 9 bytes"));
      const uint64_t off = LoadBe64(payload.data());
      const uint64_t n = len - 8;
      if (off < it->second.offset || off + n > it->second.offset + it->second.length) {
        return Err(ProtocolError("OFFSET_DATA outside the request"));
      }
      reply.data.resize(it->second.length);
      std::memcpy(reply.data.data() + (off - it->second.offset), payload.data() + 8, n);
    } else if (type == kReplyTypeError || type == kReplyTypeErrorOffset) {
      if (len < 6) return Err(ProtocolError("error chunk shorter than 6 bytes"));
      reply.error = LoadBe32(payload.data());
      const uint16_t mlen = LoadBe16(payload.data() + 4);
      if (mlen > len - 6) return Err(ProtocolError("error message longer than the chunk"));
      reply.message.assign(payload.begin() + 6, payload.begin() + 6 + mlen);
      if (reply.error == 0) return Err(ProtocolError("error chunk with error 0"));
    } else if (type != kReplyTypeNone) {
      return Err(ProtocolError(fmt::format("unexpected chunk type {}", type)));
    }
    if (flags & kReplyFlagDone) break;
  }
  in_flight_.erase(reply.handle);
  return reply;
}

Result<NbdReply> NbdTestClient::Call(uint16_t type, uint16_t flags, uint64_t offset,
                                     uint32_t length, std::span<const uint8_t> payload) {
  const uint64_t handle = next_handle_++;
  FARMEM_RETURN_IF_ERROR(Send(type, flags, handle, offset, length, payload));
  FARMEM_ASSIGN_OR_RETURN(NbdReply r, Receive());
  if (r.handle != handle) return Err(ProtocolError("reply for another handle"));
  return r;
}

Status NbdTestClient::Write(uint64_t offset, std::span<const uint8_t> data, uint16_t flags) {
  FARMEM_ASSIGN_OR_RETURN(NbdReply r,
                          Call(kCmdWrite, flags, offset, static_cast<uint32_t>(data.size()), data));
  if (r.error != 0) return IoError(fmt::format("write failed with NBD error {}", r.error));
  return Status::Ok();
}

Result<std::vector<uint8_t>> NbdTestClient::Read(uint64_t offset, uint32_t length, uint16_t flags) {
  FARMEM_ASSIGN_OR_RETURN(NbdReply r, Call(kCmdRead, flags, offset, length));
  if (r.error != 0) return Err(IoError(fmt::format("read failed with NBD error {}", r.error)));
  if (r.data.size() != length) return Err(ProtocolError("short read"));
  return std::move(r.data);
}

Status NbdTestClient::Disconnect() {
  FARMEM_RETURN_IF_ERROR(Send(kCmdDisc, 0, next_handle_++, 0, 0));
  if (!WaitForClose(timeout_)) return DeadlineExceeded("server did not close after NBD_CMD_DISC");
  return Status::Ok();
}

Status NbdTestClient::SendRaw(std::span<const uint8_t> bytes) {
  return SendAll(socket_.fd(), bytes, DeadlineIn(timeout_));
}

Status NbdTestClient::RecvRaw(std::span<uint8_t> out) {
  return RecvExact(socket_.fd(), out, DeadlineIn(timeout_));
}

bool NbdTestClient::WaitForClose(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  uint8_t buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{socket_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::recv(socket_.fd(), buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return true;  // reset counts as closed
  }
}

}  // namespace farmem::blockdev::testing
