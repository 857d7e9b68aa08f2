#include "connection.h"

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <cstring>

#include "farmem/common/auth.h"
#include "farmem/common/version.h"
#include "handshake.h"
#include "server.h"

namespace farmem::daemon {

namespace {
constexpr size_t kRecvBuffer = 256 << 10;
static_assert(kRecvBuffer >= wire::kHeaderSize + wire::kMaxControlBodyLen);
static_assert(kRecvBuffer >= kHandshakeBuffer);  // a connection's early bytes fit
static_assert(kRecvBuffer >= wire::kHeaderSize + 8 + wire::kMaxOpsPerBatch * wire::kBatchOpSize);
}  // namespace

Connection::Connection(Server* server, Socket socket, std::string peer, const Handshake& handshake,
                       std::span<const uint8_t> early)
    : server_(server),
      socket_(std::move(socket)),
      peer_(std::move(peer)),
      counted_client_(true),
      client_id_(handshake.client_id()),
      identity_(handshake.identity()),
      owner_(handshake.owner()),
      client_name_(identity_ == auth::kClusterIdentity
                       ? handshake.client_name()
                       : fmt::format("{}/{}", identity_, handshake.client_name())),
      offload_(server, client_id_, identity_, owner_, client_name_) {
  server_->ClientConnected(owner_, client_name_);
  server_->counters().connections_admitted.fetch_add(1, std::memory_order_relaxed);
  rbuf_.resize(kRecvBuffer);
  std::memcpy(rbuf_.data(), early.data(), early.size());  // at most kHandshakeBuffer bytes
  end_ = early.size();
  if (end_ > 0) frame_deadline_ = DeadlineIn(server_->options().frame_timeout);
}

Connection::~Connection() {
  if (counted_client_) server_->ClientDisconnected(owner_);
}

void Connection::Shutdown() { socket_.Shutdown(); }

void Connection::Serve() {
  ServeFrames();
  // Let the peer see the close now: the socket itself is only closed when the server reaps this
  // connection, which may be much later.
  socket_.Shutdown();
  if (counted_client_) {
    counted_client_ = false;
    server_->ClientDisconnected(owner_);
  }
}

void Connection::ServeFrames() {
  wbuf_.reserve(64 << 10);
  scratch_.resize(64 << 10);
  const std::chrono::milliseconds frame_timeout = server_->options().frame_timeout;
  for (;;) {
    Next next = Next::kNeedMore;
    while (Buffered() >= wire::kHeaderSize) {
      next = HandleFrame();
      if (next != Next::kContinue) break;
    }
    if (!FlushReplies() || next == Next::kClose) return;
    if (pos_ > 0) {
      // A frame was completed: whatever follows is the start of the next one, due in full within
      // frame_timeout from now.
      std::memmove(rbuf_.data(), Cursor(), Buffered());
      end_ -= pos_;
      pos_ = 0;
      frame_deadline_ = Buffered() > 0 ? DeadlineIn(frame_timeout) : kNoDeadline;
    }
    // A frame has started: all of it is due by frame_deadline_, however it trickles in (a byte
    // now and then does not buy more time). An idle connection, between frames, may wait.
    if (Buffered() > 0) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(frame_deadline_ - Clock::now()).count();
      pollfd p{socket_.fd(), POLLIN, 0};
      int r = 0;
      if (left > 0) {
        do {
          r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 3'600'000)));
        } while (r < 0 && errno == EINTR);
      }
      if (r == 0) {
        spdlog::warn("{} ({}): frame cut short: not complete {} ms after it started; closing",
                     peer_, client_name_, frame_timeout.count());
        return;
      }
    }
    const bool idle = Buffered() == 0;
    const ssize_t n = ::recv(socket_.fd(), rbuf_.data() + end_, rbuf_.size() - end_, 0);
    if (n == 0) {
      spdlog::debug("{} ({}) disconnected", peer_, client_name_);
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::debug("{}: receive failed: {}", peer_, strerror(errno));
      return;
    }
    end_ += static_cast<size_t>(n);
    if (idle) frame_deadline_ = DeadlineIn(frame_timeout);
  }
}

Connection::Next Connection::HandleFrame() {
  Result<wire::FrameHeader> hr = wire::DecodeHeader({Cursor(), wire::kHeaderSize});
  if (!hr.has_value()) {
    server_->counters().protocol_errors++;
    spdlog::warn("{}: {}; closing the connection", peer_, hr.error().ToString());
    ReplyError(wire::FrameHeader{}, hr.error());
    return Next::kClose;
  }
  const wire::FrameHeader h = *hr;
  server_->counters().requests[ServerCounters::Slot(h.opcode)].fetch_add(1,
                                                                         std::memory_order_relaxed);
  if (h.flags != 0) {
    server_->counters().protocol_errors++;
    ReplyError(h, ProtocolError("clients send requests: reply/push flags are not allowed"));
    return Next::kClose;
  }
  const auto op = static_cast<wire::Opcode>(h.opcode);
  const bool data_op =
      op == wire::Opcode::kRead || op == wire::Opcode::kWrite || op == wire::Opcode::kBatch;
  // The handshake is over (the admission loop ran it): a second one is a protocol error.
  if (op == wire::Opcode::kHello || op == wire::Opcode::kAuth) {
    server_->counters().protocol_errors++;
    ReplyError(h, ProtocolError(op == wire::Opcode::kHello ? "HELLO sent twice on one connection"
                                                           : "already authenticated"));
    return Next::kClose;
  }
  // A body too short for its fixed part is refused from the header alone: waiting for the fixed
  // part would read bytes of the next frame (or wait forever for bytes that never come).
  if ((op == wire::Opcode::kWrite && h.body_len < wire::kDataOpSize) ||
      (op == wire::Opcode::kBatch && h.body_len < 8)) {
    server_->counters().protocol_errors++;
    ReplyError(h, ProtocolError(fmt::format("{} body of {} bytes is shorter than its fixed part",
                                            wire::OpcodeName(h.opcode), h.body_len)));
    Consume(wire::kHeaderSize);
    return TakePayload(nullptr, h.body_len) ? Next::kContinue : Next::kClose;
  }
  if (op == wire::Opcode::kWrite) {
    if (Buffered() < wire::kHeaderSize + wire::kDataOpSize) return Next::kNeedMore;
    return HandleWrite(h);
  }
  if (op == wire::Opcode::kBatch) {
    if (Buffered() < wire::kHeaderSize + 8) return Next::kNeedMore;
    uint32_t count;
    std::memcpy(&count, Cursor() + wire::kHeaderSize, 4);
    if (count >= 1 && count <= wire::kMaxOpsPerBatch &&
        Buffered() < wire::kHeaderSize + 8 + size_t{count} * wire::kBatchOpSize &&
        h.body_len >= 8 + size_t{count} * wire::kBatchOpSize) {
      return Next::kNeedMore;
    }
    return HandleBatch(h);
  }
  const bool known = op == wire::Opcode::kStat || op == wire::Opcode::kAlloc ||
                     op == wire::Opcode::kFree || op == wire::Opcode::kHeartbeat ||
                     op == wire::Opcode::kRdmaToken || op == wire::Opcode::kParityEncode ||
                     op == wire::Opcode::kGatherCell || op == wire::Opcode::kDrain || data_op;
  if (!known) {
    server_->counters().protocol_errors++;
    Consume(wire::kHeaderSize);
    if (!TakePayload(nullptr, h.body_len)) return Next::kClose;
    ReplyError(h, Unimplemented(fmt::format("unknown opcode {}", h.opcode)));
    return Next::kContinue;
  }
  if (h.body_len > wire::kMaxControlBodyLen) {
    server_->counters().protocol_errors++;
    ReplyError(
        h, ProtocolError(fmt::format("{} body of {} bytes exceeds {}", wire::OpcodeName(h.opcode),
                                     h.body_len, wire::kMaxControlBodyLen)));
    return Next::kClose;
  }
  if (Buffered() < wire::kHeaderSize + h.body_len) return Next::kNeedMore;
  std::span<const uint8_t> body(Cursor() + wire::kHeaderSize, h.body_len);
  if (op != wire::Opcode::kRead && !pins_.empty() && !FlushReplies()) return Next::kClose;
  Next next;
  switch (op) {
    case wire::Opcode::kRead:
      next = HandleRead(h, body);
      break;
    case wire::Opcode::kParityEncode:
      next =
          HandleOffload(h, "PARITY_ENCODE", wire::DecodeParityEncode(body), &Offload::ParityEncode);
      break;
    case wire::Opcode::kGatherCell:
      next = HandleOffload(h, "GATHER_CELL", wire::DecodeGatherCell(body), &Offload::GatherCell);
      break;
    default:
      next = HandleControl(h, body);
      break;
  }
  Consume(wire::kHeaderSize + h.body_len);
  return next;
}

Connection::Next Connection::HandleControl(const wire::FrameHeader& h,
                                           std::span<const uint8_t> body) {
  SlabPool& pool = server_->pool();
  body_.clear();
  switch (static_cast<wire::Opcode>(h.opcode)) {
    case wire::Opcode::kStat: {
      const PoolStats ps = pool.stats();
      wire::StatReply r;
      r.node_id = server_->node_id();
      r.capacity = ps.capacity;
      r.slab_size = ps.slab_size;
      r.total_slabs = ps.total_slabs;
      r.free_slabs = ps.free_slabs;
      const SlabPool::ClientRoom room = pool.RoomFor(owner_);
      r.client_free_slabs = room.may_take;
      r.client_max_slabs = room.limit;
      r.clients = server_->client_count();
      r.features = wire::kFeatureClientShare | wire::kFeatureVersion;
      r.version = std::string(kVersionString);
      if (!server_->options().secret.empty()) r.features |= wire::kFeatureAuthRequired;
      if (ps.draining) r.features |= wire::kStateDraining;
      if (ps.holding) r.features |= wire::kStateUnderPressure;
      if (server_->rdma() != nullptr) {
        r.features |= wire::kFeatureVerbs;
        r.rdma_port = server_->rdma()->port();
      }
      r.ops = server_->counters().ops.load(std::memory_order_relaxed);
      r.bytes_read = server_->counters().bytes_read.load(std::memory_order_relaxed);
      r.bytes_written = server_->counters().bytes_written.load(std::memory_order_relaxed);
      wire::EncodeStatReply(r, &body_);
      break;
    }
    case wire::Opcode::kAlloc: {
      Result<wire::AllocRequest> req = wire::DecodeAlloc(body);
      if (!req.has_value()) {
        ReplyError(h, req.error());
        return Next::kContinue;
      }
      control_.store(true, std::memory_order_relaxed);
      Result<std::vector<wire::LeaseGrant>> leases = pool.Grant(req->count, owner_);
      if (!leases.has_value()) {
        ReplyError(h, leases.error());
        return Next::kContinue;
      }
      pool.Renew(owner_);
      spdlog::info("granted {} slab(s) to {} ({})", leases->size(), client_name_, peer_);
      wire::EncodeAllocReply({std::move(*leases)}, &body_);
      break;
    }
    case wire::Opcode::kFree: {
      Result<wire::FreeRequest> req = wire::DecodeFree(body);
      if (!req.has_value()) {
        ReplyError(h, req.error());
        return Next::kContinue;
      }
      Status s = pool.Release(req->lease_ids, owner_);
      if (!s.ok()) {
        NoteRefusal(s);
        ReplyError(h, s);
        return Next::kContinue;
      }
      spdlog::info("{} ({}) freed {} slab(s)", client_name_, peer_, req->lease_ids.size());
      break;
    }
    case wire::Opcode::kHeartbeat: {
      // Empty, or the client's counts of its RDMA accesses (kFeatureAccessReports): credited to
      // its leases for victim choice, since one-sided verbs never reach this CPU.
      Result<wire::HeartbeatRequest> req = wire::DecodeHeartbeat(body);
      if (!req.has_value()) {
        server_->counters().protocol_errors++;
        ReplyError(h, req.error());
        return Next::kContinue;
      }
      control_.store(true, std::memory_order_relaxed);
      if (!req->reports.empty()) (void)pool.CreditAccesses(owner_, req->reports);
      wire::HeartbeatReply r;
      // With the leases under notice: a notice pushed on a connection that has closed since (a
      // restarted client re-adopting its leases, a reconnect) reaches the client this way.
      r.leases_held = pool.Renew(owner_, &r.noticed);
      r.lease_ttl_ms = static_cast<uint64_t>(pool.lease_ttl().count());
      wire::EncodeHeartbeatReply(r, &body_);
      break;
    }
    case wire::Opcode::kRdmaToken: {
      if (!body.empty()) {
        ReplyError(h, InvalidArgument("RDMA_TOKEN carries no body"));
        return Next::kContinue;
      }
      if (server_->rdma() == nullptr) {
        ReplyError(h, Unavailable("this daemon does not serve RDMA (--rdma off, or no RDMA "
                                  "device): use the tcp transport"));
        return Next::kContinue;
      }
      Result<wire::RdmaTokenReply> token = server_->rdma()->IssueToken(owner_);
      if (!token.has_value()) {
        ReplyError(h, token.error());
        return Next::kContinue;
      }
      wire::EncodeRdmaTokenReply(*token, &body_);
      break;
    }
    case wire::Opcode::kDrain: {  // docs/operations.md "Drain"
      Result<wire::DrainRequest> req = wire::DecodeDrain(body);
      if (!req.has_value()) {
        ReplyError(h, req.error());
        return Next::kContinue;
      }
      // Draining takes memory from every client: the administrator's (the cluster secret's).
      if (!server_->options().secret.empty() && identity_ != auth::kClusterIdentity) {
        ReplyError(h, PermissionDenied(fmt::format(
                          "DRAIN is for the cluster administrator: identity '{}' may not; use "
                          "the cluster secret (farmemctl drain --secret-file)",
                          identity_)));
        return Next::kContinue;
      }
      spdlog::warn("{} ({}) asks to {}", client_name_, peer_, req->drain ? "drain" : "undrain");
      wire::DrainReply r;
      if (req->drain) {
        r.leases_noticed = server_->Drain(std::chrono::milliseconds(req->grace_ms));
      } else {
        server_->Undrain();
      }
      r.leases_held = pool.stats().leased_slabs;
      wire::EncodeDrainReply(r, &body_);
      break;
    }
    default:
      ReplyError(h, Internal("control dispatch reached an unexpected opcode"));
      return Next::kContinue;
  }
  Reply(h, body_);
  return Next::kContinue;
}

Connection::Next Connection::HandleRead(const wire::FrameHeader& h, std::span<const uint8_t> body) {
  if (body.size() != wire::kDataOpSize) {
    ReplyError(h, InvalidArgument(fmt::format("READ body must be {} bytes, got {}",
                                              wire::kDataOpSize, body.size())));
    return Next::kContinue;
  }
  Result<wire::DataOp> op = wire::DecodeDataOp(body);
  if (!op.has_value()) {
    ReplyError(h, op.error());
    return Next::kContinue;
  }
  Result<Pin> pin = server_->pool().Acquire(op->lease_id, owner_, op->offset, op->length);
  if (!pin.has_value()) {
    NoteRefusal(pin.error());
    ReplyError(h, pin.error());
    return Next::kContinue;
  }
  wire::FrameHeader r = h;
  r.flags = wire::kFlagReply;
  r.body_len = op->length;
  const size_t at = wbuf_.size();
  wbuf_.resize(at + wire::kHeaderSize);
  wire::EncodeHeader(r, wbuf_.data() + at);
  pieces_.push_back({at, nullptr, wire::kHeaderSize});
  const uint8_t* data = pin->data() + op->offset;
  AddExternal(data, op->length, std::move(*pin));
  ServerCounters& counters = server_->counters();
  counters.ops.fetch_add(1, std::memory_order_relaxed);
  counters.bytes_read.fetch_add(op->length, std::memory_order_relaxed);
  counters.request_bytes[static_cast<size_t>(wire::Opcode::kRead)].fetch_add(
      op->length, std::memory_order_relaxed);
  return Next::kContinue;
}

Connection::Next Connection::HandleWrite(const wire::FrameHeader& h) {
  Result<wire::DataOp> op = wire::DecodeDataOp({Cursor() + wire::kHeaderSize, wire::kDataOpSize});
  if (!op.has_value() || h.body_len != wire::kDataOpSize + uint64_t{op->length}) {
    server_->counters().protocol_errors++;
    ReplyError(h, op.has_value()
                      ? ProtocolError(fmt::format("WRITE of {} bytes in a body of {} bytes",
                                                  op->length, h.body_len))
                      : op.error());
    // The body length is still trustworthy framing: skip the body and go on.
    Consume(wire::kHeaderSize);
    return TakePayload(nullptr, h.body_len) ? Next::kContinue : Next::kClose;
  }
  if (!pins_.empty() && !FlushReplies()) return Next::kClose;
  Consume(wire::kHeaderSize + wire::kDataOpSize);
  Result<Pin> pin = server_->pool().Acquire(op->lease_id, owner_, op->offset, op->length);
  if (!pin.has_value()) {
    NoteRefusal(pin.error());
    if (!TakePayload(nullptr, op->length)) return Next::kClose;
    ReplyError(h, pin.error());
    return Next::kContinue;
  }
  if (!TakePayload(pin->data() + op->offset, op->length)) return Next::kClose;
  pin->Reset();
  ServerCounters& counters = server_->counters();
  counters.ops.fetch_add(1, std::memory_order_relaxed);
  counters.bytes_written.fetch_add(op->length, std::memory_order_relaxed);
  counters.request_bytes[static_cast<size_t>(wire::Opcode::kWrite)].fetch_add(
      op->length, std::memory_order_relaxed);
  Reply(h, {});
  return Next::kContinue;
}

Connection::Next Connection::HandleBatch(const wire::FrameHeader& h) {
  const size_t avail = Buffered() - wire::kHeaderSize;
  Result<wire::BatchDescriptors> d =
      wire::DecodeBatch({Cursor() + wire::kHeaderSize, avail}, h.body_len);
  if (!d.has_value()) {
    server_->counters().protocol_errors++;
    ReplyError(h, d.error());
    Consume(wire::kHeaderSize);
    return TakePayload(nullptr, h.body_len) ? Next::kContinue : Next::kClose;
  }
  if (d->write_bytes > 0 && !pins_.empty() && !FlushReplies()) return Next::kClose;
  Consume(wire::kHeaderSize + d->payload_offset);
  const size_t n = d->ops.size();
  const size_t pieces_before = pieces_.size(), pins_before = pins_.size();
  // Reply: header, count, reserved, one u32 status per op, then the data of the OK reads.
  const size_t at = wbuf_.size();
  const size_t table = wire::BatchReplyTableSize(n);
  wbuf_.resize(at + wire::kHeaderSize + table);
  wire::EncodeBatchReplyTable(static_cast<uint32_t>(n), wbuf_.data() + at + wire::kHeaderSize);
  pieces_.push_back({at, nullptr, wire::kHeaderSize + table});
  uint64_t read_bytes = 0, written_bytes = 0;
  auto& counters = server_->counters();
  for (size_t i = 0; i < n; ++i) {
    const wire::BatchOp& op = d->ops[i];
    Result<Pin> pin = server_->pool().Acquire(op.lease_id, owner_, op.offset, op.length);
    if (!pin.has_value()) NoteRefusal(pin.error());
    uint16_t code = pin.has_value() ? 0 : static_cast<uint16_t>(pin.error().code());
    if (op.op == wire::Opcode::kWrite) {
      if (!TakePayload(pin.has_value() ? pin->data() + op.offset : nullptr, op.length)) {
        // Drop this batch's half-built reply (its header is not written yet).
        pieces_.resize(pieces_before);
        pins_.resize(pins_before);
        wbuf_.resize(at);
        return Next::kClose;
      }
      if (pin.has_value()) {
        counters.bytes_written.fetch_add(op.length, std::memory_order_relaxed);
        written_bytes += op.length;
      }
    } else if (pin.has_value()) {
      const uint8_t* data = pin->data() + op.offset;
      AddExternal(data, op.length, std::move(*pin));
      read_bytes += op.length;
      counters.bytes_read.fetch_add(op.length, std::memory_order_relaxed);
    }
    // wbuf_ may have moved: address the table by offset.
    wire::SetBatchReplyStatus(wbuf_.data() + at + wire::kHeaderSize, i, code);
  }
  counters.ops.fetch_add(n, std::memory_order_relaxed);
  counters.request_bytes[static_cast<size_t>(wire::Opcode::kBatch)].fetch_add(
      read_bytes + written_bytes, std::memory_order_relaxed);
  wire::FrameHeader r = h;
  r.flags = wire::kFlagReply;
  r.body_len = static_cast<uint32_t>(table + read_bytes);
  wire::EncodeHeader(r, wbuf_.data() + at);
  return Next::kContinue;
}

template <typename Req>
Connection::Next Connection::HandleOffload(const wire::FrameHeader& h, const char* name,
                                           Result<Req> req,
                                           Status (Offload::*run)(const Req&,
                                                                  std::vector<uint8_t>*)) {
  if (!req.has_value()) {
    ReplyError(h, req.error());
    return Next::kContinue;
  }
  // What is already answered goes out first: this request may take a while.
  if (!FlushReplies()) return Next::kClose;
  std::vector<uint8_t> reply;
  Status s = (offload_.*run)(*req, &reply);
  if (!s.ok()) {
    spdlog::debug("{} ({}): {} failed: {}", peer_, client_name_, name, s.ToString());
    ReplyError(h, s);
    return Next::kContinue;
  }
  Reply(h, reply);
  return Next::kContinue;
}

bool Connection::TakePayload(uint8_t* dst, uint64_t len) {
  const size_t from_buffer = static_cast<size_t>(std::min<uint64_t>(Buffered(), len));
  if (dst != nullptr && from_buffer > 0) std::memcpy(dst, Cursor(), from_buffer);
  Consume(from_buffer);
  uint64_t rest = len - from_buffer;
  if (rest == 0) return true;
  // The payload is part of the frame that is arriving: same deadline.
  const Deadline deadline = frame_deadline_ != kNoDeadline
                                ? frame_deadline_
                                : DeadlineIn(server_->options().frame_timeout);
  Status s;
  if (dst != nullptr) {
    s = RecvExact(socket_.fd(), {dst + from_buffer, static_cast<size_t>(rest)}, deadline);
  } else {
    while (rest > 0 && s.ok()) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(rest, scratch_.size()));
      s = RecvExact(socket_.fd(), {scratch_.data(), chunk}, deadline);
      rest -= chunk;
    }
  }
  if (!s.ok()) {
    spdlog::warn("{} ({}): frame cut short: {}; closing", peer_, client_name_, s.ToString());
    return false;
  }
  return true;
}

void Connection::Reply(const wire::FrameHeader& req, std::span<const uint8_t> body) {
  const size_t at = wbuf_.size();
  AppendReply(req, body, &wbuf_);
  pieces_.push_back({at, nullptr, wbuf_.size() - at});
}

void Connection::ReplyError(const wire::FrameHeader& req, const Status& status) {
  spdlog::debug("{}: {} failed: {}", peer_, wire::OpcodeName(req.opcode), status.ToString());
  const size_t at = wbuf_.size();
  AppendErrorReply(req, status, &wbuf_);
  pieces_.push_back({at, nullptr, wbuf_.size() - at});
}

void Connection::NoteRefusal(const Status& status) {
  if (status.code() != StatusCode::kPermissionDenied) return;
  server_->foreign_lease_refusals().fetch_add(1, std::memory_order_relaxed);
  ++foreign_unlogged_;
  const Clock::time_point now = Clock::now();
  if (now - foreign_logged_ < std::chrono::seconds(1)) return;
  spdlog::warn("{} ({}, identity '{}'): {} lease operation(s) refused: {}", peer_, client_name_,
               identity_, foreign_unlogged_, status.message());
  foreign_logged_ = now;
  foreign_unlogged_ = 0;
}

void Connection::AddExternal(const uint8_t* data, size_t len, Pin pin) {
  pieces_.push_back({0, data, len});
  pins_.push_back(std::move(pin));
}

void Connection::QueuePush(std::vector<uint8_t> frame) {
  MutexLock lock(&push_mu_);
  pushes_.push_back(std::move(frame));
}

bool Connection::FlushReplies() {
  {
    // Eviction notices go ahead of the replies: a client waiting for a reply reads them first.
    MutexLock lock(&push_mu_);
    for (std::vector<uint8_t>& f : pushes_) {
      const size_t at = wbuf_.size();
      wbuf_.insert(wbuf_.end(), f.begin(), f.end());
      pieces_.insert(pieces_.begin(), {at, nullptr, f.size()});
    }
    pushes_.clear();
  }
  if (pieces_.empty()) return true;
  iov_.clear();
  for (const Piece& p : pieces_) {
    iov_.push_back(
        {const_cast<uint8_t*>(p.data != nullptr ? p.data : wbuf_.data() + p.offset), p.len});
  }
  Status s = SendAll(socket_.fd(), iov_.data(), static_cast<int>(iov_.size()),
                     DeadlineIn(server_->options().frame_timeout));
  pieces_.clear();
  wbuf_.clear();
  pins_.clear();
  if (!s.ok()) {
    spdlog::debug("{}: sending replies failed: {}", peer_, s.ToString());
    return false;
  }
  return true;
}

}  // namespace farmem::daemon
