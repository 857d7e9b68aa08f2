// The TCP implementation of the transport interface: each channel is one authenticated TCP
// connection. Posted operations are sent by Flush() as one READ/WRITE frame (a lone op) or as
// BATCH frames (the vectored form: many ops, one header, one reply), with write payloads sent
// straight from the caller's buffers and read payloads received straight into them (scatter-
// gather I/O, no staging copy of data). Replies are matched by request id.
//
// Receiving: with one frame in flight (the common case: a caller posts a round, flushes, waits)
// the reply's layout on success is known in advance — header, BATCH status table, the read data
// in op order — so one recvmsg() lands all of it in place. Anything else (an error reply, a failed
// read, several frames in flight) is parsed piece by piece; bytes the one-shot receive took beyond
// a header it did not expect are kept in carry_ and consumed first.
#include <fmt/format.h>
#include <sys/socket.h>

#include <deque>

#include "farmem/transport/tcp_connection.h"
#include "farmem/transport/transport.h"

namespace farmem::transport {
namespace {

class PlainRegion final : public LocalRegion {
 public:
  PlainRegion(void* addr, size_t length) : addr_(addr), length_(length) {}
  void* addr() const override { return addr_; }
  size_t length() const override { return length_; }
  uint32_t lkey() const override { return 0; }

 private:
  void* addr_;
  size_t length_;
};

class TcpChannel final : public Channel {
 public:
  TcpChannel(TcpConnection conn, const ChannelOptions& options)
      : conn_(std::move(conn)), options_(options) {
    staging_.reserve(wire::kHeaderSize + 8 + wire::kMaxOpsPerBatch * wire::kBatchOpSize);
  }

  Status Post(const Op& op) override {
    if (!broken_.ok()) return broken_;
    if (op.length == 0 || op.length > wire::kMaxDataLen || op.local == nullptr) {
      return InvalidArgument(
          fmt::format("operation of {} bytes at {}: length must be 1 to {} with "
                      "a buffer",
                      op.length, op.local, wire::kMaxDataLen));
    }
    if (outstanding() >= max_outstanding()) {
      return ResourceExhausted(
          fmt::format("{} operations already outstanding on {}", outstanding(), peer()));
    }
    pending_.push_back(op);
    return Status::Ok();
  }

  Status Flush() override {
    if (!broken_.ok()) return broken_;
    while (!pending_.empty()) {
      // Take the longest prefix that fits one frame.
      size_t n = 0;
      uint64_t wbytes = 0, rbytes = 0;
      while (n < pending_.size() && n < wire::kMaxOpsPerBatch) {
        const Op& op = pending_[n];
        uint64_t& dir = op.type == OpType::kWrite ? wbytes : rbytes;
        if (n > 0 && dir + op.length > wire::kMaxDataLen) break;
        dir += op.length;
        ++n;
      }
      Status s = SendFrame(n);
      if (!s.ok()) {
        Break(s.WithContext(fmt::format("sending to {}", peer())));
        return broken_;
      }
      ++stats_.doorbells;
    }
    return Status::Ok();
  }

  Result<size_t> Poll(std::span<Completion> out, std::chrono::milliseconds timeout) override {
    size_t n = Drain(out);
    if (n > 0 || inflight_.empty() || out.empty()) return n;
    if (timeout.count() == 0) {
      uint8_t probe;
      // recv() returning 0 (the daemon closed) leaves errno alone: only < 0 may look at it.
      const ssize_t r = ::recv(conn_.socket().fd(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return size_t{0};
    }
    if (timeout != rcv_timeout_) {
      FARMEM_RETURN_IF_ERROR(SetReceiveTimeout(conn_.socket().fd(), timeout));
      rcv_timeout_ = timeout;
    }
    Status s = ReceiveReply();
    // Bytes held back by a one-shot receive belong to frames not yet handled: finish them now
    // (the socket turning readable would not announce them).
    while (s.ok() && carry_pos_ < carry_.size()) s = ReceiveReply();
    if (!s.ok()) Break(s);
    return Drain(out);
  }

  size_t outstanding() const override { return pending_.size() + inflight_ops_ + done_.size(); }
  size_t max_outstanding() const override { return options_.max_outstanding; }
  const char* kind() const override { return "tcp"; }
  std::string peer() const override { return options_.endpoint.ToString(); }
  bool broken() const override { return !broken_.ok(); }
  ChannelStats stats() const override { return stats_; }
  int wait_fd() const override { return broken() ? -1 : conn_.socket().fd(); }

 private:
  struct InFlight {
    uint64_t request_id;
    bool batch;
    std::vector<Op> ops;
  };

  Status SendFrame(size_t n) {
    InFlight f{conn_.NextRequestId(), n > 1, {pending_.begin(), pending_.begin() + n}};
    pending_.erase(pending_.begin(), pending_.begin() + n);
    staging_.clear();
    iov_.clear();
    uint32_t body_len = 0;
    wire::FrameHeader h;
    h.request_id = f.request_id;
    staging_.resize(wire::kHeaderSize);
    if (!f.batch) {
      const Op& op = f.ops[0];
      h.opcode = static_cast<uint8_t>(op.type == OpType::kRead ? wire::Opcode::kRead
                                                               : wire::Opcode::kWrite);
      body_len = wire::kDataOpSize + (op.type == OpType::kWrite ? op.length : 0);
      staging_.resize(wire::kHeaderSize + wire::kDataOpSize);
      wire::EncodeDataOp({op.slab.lease_id, op.offset, op.length},
                         staging_.data() + wire::kHeaderSize);
    } else {
      h.opcode = static_cast<uint8_t>(wire::Opcode::kBatch);
      const size_t table = 8 + f.ops.size() * wire::kBatchOpSize;
      staging_.resize(wire::kHeaderSize + table);
      uint8_t* p = staging_.data() + wire::kHeaderSize;
      const uint32_t count = static_cast<uint32_t>(f.ops.size());
      std::memcpy(p, &count, 4);
      std::memset(p + 4, 0, 4);
      p += 8;
      body_len = static_cast<uint32_t>(table);
      for (const Op& op : f.ops) {
        wire::EncodeBatchOp({op.type == OpType::kRead ? wire::Opcode::kRead : wire::Opcode::kWrite,
                             op.length, op.slab.lease_id, op.offset},
                            p);
        p += wire::kBatchOpSize;
        if (op.type == OpType::kWrite) body_len += op.length;
      }
    }
    h.body_len = body_len;
    wire::EncodeHeader(h, staging_.data());
    iov_.push_back({staging_.data(), staging_.size()});
    for (const Op& op : f.ops) {
      if (op.type == OpType::kWrite) iov_.push_back({op.local, op.length});
    }
    inflight_ops_ += f.ops.size();
    inflight_.push_back(std::move(f));
    return SendAll(conn_.socket().fd(), iov_.data(), static_cast<int>(iov_.size()),
                   DeadlineIn(options_.op_timeout));
  }

  // Receives one reply frame and turns it into completions.
  Status ReceiveReply() {
    uint8_t hdr[wire::kHeaderSize];
    if (inflight_.size() == 1 && carry_pos_ == carry_.size()) {
      Result<bool> done = ReceiveExpected(hdr);
      if (!done.has_value()) return done.error().WithContext(fmt::format("waiting for {}", peer()));
      if (*done) return Status::Ok();
      // hdr holds a header other than the expected success; what followed it is in carry_.
    } else {
      FARMEM_RETURN_IF_ERROR(Recv(hdr).WithContext(fmt::format("waiting for {}", peer())));
    }
    FARMEM_ASSIGN_OR_RETURN(wire::FrameHeader h, wire::DecodeHeader(hdr));
    if (h.flags & wire::kFlagPush) {  // not expected on data channels: skip its body
      std::vector<uint8_t> skip(h.body_len);
      return Recv(skip);
    }
    auto it = inflight_.begin();
    while (it != inflight_.end() && it->request_id != h.request_id) ++it;
    if (!h.is_reply() || it == inflight_.end()) {
      return ProtocolError(
          fmt::format("{} answered request id {} which is not outstanding", peer(), h.request_id));
    }
    InFlight f = std::move(*it);
    inflight_.erase(it);
    inflight_ops_ -= f.ops.size();
    if (h.status != 0) {  // the whole frame failed: every op in it gets the error
      if (h.body_len > wire::kMaxErrorMessage) {
        return ProtocolError(fmt::format("{} sent an error of {} bytes", peer(), h.body_len));
      }
      std::vector<uint8_t> msg(h.body_len);
      FARMEM_RETURN_IF_ERROR(Recv(msg));
      Status err = wire::DecodeError(h.status, msg).WithContext(peer());
      for (const Op& op : f.ops) done_.push_back({op.user_data, err});
      return Status::Ok();
    }
    if (!f.batch) {
      const Op& op = f.ops[0];
      const uint32_t want = op.type == OpType::kRead ? op.length : 0;
      if (h.body_len != want) {
        return ProtocolError(fmt::format("{} answered a {}-byte {} with {} bytes", peer(),
                                         op.length, op.type == OpType::kRead ? "READ" : "WRITE",
                                         h.body_len));
      }
      if (want) FARMEM_RETURN_IF_ERROR(Recv({static_cast<uint8_t*>(op.local), want}));
      Account(op);
      done_.push_back({op.user_data, Status::Ok()});
      return Status::Ok();
    }
    // BATCH reply: count, reserved, one u32 status per op, then read data for the OK reads.
    const size_t table = 8 + 4 * f.ops.size();
    if (h.body_len < table) return ProtocolError(fmt::format("{}: short BATCH reply", peer()));
    staging_.resize(table);
    FARMEM_RETURN_IF_ERROR(Recv(staging_));
    wire::Reader r(staging_);
    if (r.U32() != f.ops.size())
      return ProtocolError(fmt::format("{}: BATCH count mismatch", peer()));
    r.U32();
    iov_.clear();
    uint64_t data = 0;
    std::vector<uint16_t> codes(f.ops.size());
    for (size_t i = 0; i < f.ops.size(); ++i) {
      codes[i] = static_cast<uint16_t>(r.U32());
      if (codes[i] == 0 && f.ops[i].type == OpType::kRead) {
        iov_.push_back({f.ops[i].local, f.ops[i].length});
        data += f.ops[i].length;
      }
    }
    if (h.body_len != table + data) {
      return ProtocolError(fmt::format("{}: BATCH reply of {} bytes, expected {}", peer(),
                                       h.body_len, table + data));
    }
    FARMEM_RETURN_IF_ERROR(RecvV(iov_.data(), static_cast<int>(iov_.size())));
    for (size_t i = 0; i < f.ops.size(); ++i) CompleteBatchOp(f.ops[i], codes[i]);
    return Status::Ok();
  }

  // The one-shot receive (see the top of this file): true if the oldest frame in flight got its
  // expected success reply, now received and completed; false with some other header in `hdr`
  // and the bytes received after it in carry_.
  Result<bool> ReceiveExpected(uint8_t* hdr) {
    const int fd = conn_.socket().fd();
    const InFlight& f = inflight_.front();
    iov_.clear();
    iov_.push_back({hdr, wire::kHeaderSize});
    size_t table = 0;
    uint64_t data = 0;
    if (f.batch) {
      table = 8 + 4 * f.ops.size();
      staging_.resize(table);
      iov_.push_back({staging_.data(), table});
    }
    for (const Op& op : f.ops) {
      if (op.type == OpType::kRead) {
        iov_.push_back({op.local, op.length});
        data += op.length;
      }
    }
    const size_t total = wire::kHeaderSize + table + data;
    msghdr msg{};
    msg.msg_iov = iov_.data();
    msg.msg_iovlen = std::min<size_t>(iov_.size(), IOV_MAX);
    ssize_t n;
    do {
      n = ::recvmsg(fd, &msg, 0);  // whatever has arrived; the socket's SO_RCVTIMEO bounds it
    } while (n < 0 && errno == EINTR);
    if (n == 0) return Err(Unavailable("connection closed by peer"));
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return Err(DeadlineExceeded("receive timed out"));
      return Err(ErrnoStatus(StatusCode::kUnavailable, "receive", errno));
    }
    size_t got = static_cast<size_t>(n);
    if (got < wire::kHeaderSize) {
      FARMEM_RETURN_IF_ERROR(RecvExact(fd, {hdr + got, wire::kHeaderSize - got}, kNoDeadline));
      got = wire::kHeaderSize;
    }
    Result<wire::FrameHeader> h = wire::DecodeHeader({hdr, wire::kHeaderSize});
    const bool expected = h.has_value() && h->is_reply() && (h->flags & wire::kFlagPush) == 0 &&
                          h->request_id == f.request_id && h->status == 0 &&
                          h->body_len == total - wire::kHeaderSize;
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
      FARMEM_RETURN_IF_ERROR(RecvExactV(fd, rest, rest_n, kNoDeadline));
    }
    InFlight done = std::move(inflight_.front());
    inflight_.pop_front();
    inflight_ops_ -= done.ops.size();
    if (!done.batch) {
      Account(done.ops[0]);
      done_.push_back({done.ops[0].user_data, Status::Ok()});
      return true;
    }
    // Every read succeeded (the body has all their data); a write may still have failed.
    wire::Reader r(staging_);
    if (r.U32() != done.ops.size()) {
      return Err(ProtocolError(fmt::format("{}: BATCH count mismatch", peer())));
    }
    r.U32();
    for (const Op& op : done.ops) CompleteBatchOp(op, static_cast<uint16_t>(r.U32()));
    return true;
  }

  void CompleteBatchOp(const Op& op, uint16_t code) {
    if (code == 0) {
      Account(op);
      done_.push_back({op.user_data, Status::Ok()});
      return;
    }
    done_.push_back(
        {op.user_data, Status(StatusCodeFromWire(code),
                              fmt::format("{}: {} of {} bytes at offset {} of lease {:#x} failed",
                                          peer(), op.type == OpType::kRead ? "read" : "write",
                                          op.length, op.offset, op.slab.lease_id))});
  }

  // Exactly out.size() / the iovecs' bytes of the stream: first what carry_ holds, then the socket.
  Status Recv(std::span<uint8_t> out) {
    iovec iov{out.data(), out.size()};
    return RecvV(&iov, 1);
  }
  Status RecvV(iovec* iov, int n) {
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
    return RecvExactV(conn_.socket().fd(), iov, n, kNoDeadline);
  }

  void Account(const Op& op) {
    ++stats_.ops;
    (op.type == OpType::kRead ? stats_.bytes_read : stats_.bytes_written) += op.length;
  }

  size_t Drain(std::span<Completion> out) {
    size_t n = 0;
    while (n < out.size() && !done_.empty()) {
      out[n++] = std::move(done_.front());
      done_.pop_front();
    }
    return n;
  }

  // The stream can no longer be trusted: everything outstanding completes with `why`.
  void Break(Status why) {
    if (broken_.ok()) broken_ = std::move(why);
    for (InFlight& f : inflight_) {
      for (const Op& op : f.ops) done_.push_back({op.user_data, broken_});
    }
    inflight_.clear();
    inflight_ops_ = 0;
    for (const Op& op : pending_) done_.push_back({op.user_data, broken_});
    pending_.clear();
    conn_.Shutdown();
  }

  TcpConnection conn_;
  ChannelOptions options_;
  std::vector<Op> pending_;
  std::deque<InFlight> inflight_;
  size_t inflight_ops_ = 0;
  std::deque<Completion> done_;
  std::vector<uint8_t> staging_;
  std::vector<iovec> iov_;
  std::vector<uint8_t> carry_;  // received, not yet consumed (see ReceiveExpected)
  size_t carry_pos_ = 0;
  Status broken_;
  std::chrono::milliseconds rcv_timeout_{0};
  ChannelStats stats_;
};

class TcpTransport final : public Transport {
 public:
  const char* kind() const override { return "tcp"; }
  Result<std::unique_ptr<Channel>> OpenChannel(const ChannelOptions& options) override {
    FARMEM_ASSIGN_OR_RETURN(TcpConnection conn, TcpConnection::Connect(options));
    return std::unique_ptr<Channel>(new TcpChannel(std::move(conn), options));
  }
  Result<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, size_t length) override {
    return std::unique_ptr<LocalRegion>(new PlainRegion(addr, length));
  }
};

}  // namespace

std::unique_ptr<Transport> MakeTcpTransport() { return std::make_unique<TcpTransport>(); }

}  // namespace farmem::transport
