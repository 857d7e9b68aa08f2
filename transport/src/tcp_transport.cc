// The TCP implementation of the transport interface: each channel is one authenticated
// TcpConnection. Posted operations are sent by Flush() as one READ/WRITE frame (a lone op) or as
// BATCH frames (the vectored form: many ops, one header, one reply), with write payloads sent
// straight from the caller's buffers and read payloads received straight into them (scatter-
// gather I/O, no staging copy of data). Replies are matched by request id (TcpConnection).
//
// Receiving: the reply's layout on success is known in advance — header, BATCH status table, the
// read data in op order — so the connection lands all of it in place with one recvmsg(). Anything
// else (an error reply, a failed read in a batch) is taken piece by piece.
#include <fmt/format.h>

#include <optional>

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
    staging_.reserve(wire::BatchRequestTableSize(wire::kMaxOpsPerBatch));
    // Everything the data path keeps per operation or frame, sized now for max_outstanding
    // operations (a frame holds at least one): Post, Flush and Poll then allocate nothing
    // (farmem-nbd's swap safety, docs/nbd.md). Beyond kReserved they would grow once.
    const size_t n = std::min<size_t>(options_.max_outstanding, kReserved);
    pending_.reserve(n);
    inflight_.reserve(n);
    spare_ops_.reserve(n);
    done_.reserve(n);
    codes_.reserve(wire::kMaxOpsPerBatch);
    iov_.reserve(wire::kMaxOpsPerBatch + 1);
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
    if (timeout.count() == 0 && !conn_.ReplyWaiting()) return size_t{0};
    FARMEM_RETURN_IF_ERROR(conn_.SetReceiveTimeout(timeout));
    Status s = ReceiveReply();
    // Replies (or parts) the connection already holds: finish them now (the socket turning
    // readable would not announce them).
    while (s.ok() && !inflight_.empty() && (conn_.buffered() || conn_.ArrivedReply())) {
      s = ReceiveReply();
    }
    if (!s.ok()) Break(s);
    return Drain(out);
  }

  size_t outstanding() const override {
    return pending_.size() + inflight_ops_ + (done_.size() - done_head_);
  }
  size_t max_outstanding() const override { return options_.max_outstanding; }
  const char* kind() const override { return "tcp"; }
  std::string peer() const override { return options_.endpoint.ToString(); }
  bool broken() const override { return !broken_.ok(); }
  ChannelStats stats() const override { return stats_; }
  int wait_fd() const override { return broken() ? -1 : conn_.pollable_fd(); }
  bool fd_readiness_is_exact() const override { return true; }

 private:
  struct InFlight {
    uint64_t request_id;
    bool batch;
    std::vector<Op> ops;
  };

  Status SendFrame(size_t n) {
    std::vector<Op> ops;  // a retired frame's, capacity kept
    if (!spare_ops_.empty()) {
      ops = std::move(spare_ops_.back());
      spare_ops_.pop_back();
    } else {  // room for the largest frame: a list is never grown afterwards
      ops.reserve(std::min<size_t>(options_.max_outstanding, wire::kMaxOpsPerBatch));
    }
    ops.assign(pending_.begin(), pending_.begin() + n);
    inflight_.push_back({0, n > 1, std::move(ops)});
    pending_.erase(pending_.begin(), pending_.begin() + n);
    InFlight& f = inflight_.back();
    inflight_ops_ += f.ops.size();
    wire::Opcode opcode = wire::Opcode::kBatch;
    iov_.clear();
    if (!f.batch) {
      const Op& op = f.ops[0];
      opcode = op.type == OpType::kRead ? wire::Opcode::kRead : wire::Opcode::kWrite;
      staging_.resize(wire::kDataOpSize);
      wire::EncodeDataOp({op.slab.lease_id, op.offset, op.length}, staging_.data());
    } else {
      staging_.resize(wire::BatchRequestTableSize(f.ops.size()));
      wire::EncodeBatchCount(static_cast<uint32_t>(f.ops.size()), staging_.data());
      uint8_t* p = staging_.data() + wire::kBatchCountSize;
      for (const Op& op : f.ops) {
        wire::EncodeBatchOp({op.type == OpType::kRead ? wire::Opcode::kRead : wire::Opcode::kWrite,
                             op.length, op.slab.lease_id, op.offset},
                            p);
        p += wire::kBatchOpSize;
      }
    }
    iov_.push_back({staging_.data(), staging_.size()});
    for (const Op& op : f.ops) {
      if (op.type == OpType::kWrite) iov_.push_back({op.local, op.length});
    }
    FARMEM_ASSIGN_OR_RETURN(f.request_id,
                            conn_.SendV(opcode, iov_, DeadlineIn(options_.op_timeout)));
    return Status::Ok();
  }

  // Receives one reply frame and turns it into completions. A failure leaves its frame in
  // inflight_ for Break() to complete.
  Status ReceiveReply() {
    // A reply the connection already holds first, else the oldest frame's.
    auto it = inflight_.begin();
    if (std::optional<uint64_t> arrived = conn_.ArrivedReply()) {
      while (it != inflight_.end() && it->request_id != *arrived) ++it;
      if (it == inflight_.end())
        return Internal(fmt::format("{}: reply to an unknown frame", peer()));
    }
    InFlight& f = *it;
    // Where the reply goes on success: the BATCH status table, then the data of every read.
    iov_.clear();
    size_t table = 0;
    if (f.batch) {
      table = wire::BatchReplyTableSize(f.ops.size());
      staging_.resize(table);
      iov_.push_back({staging_.data(), table});
    }
    for (const Op& op : f.ops) {
      if (op.type == OpType::kRead) iov_.push_back({op.local, op.length});
    }
    Result<TcpConnection::Reply> r = conn_.ReceiveV(f.request_id, iov_, kNoDeadline);
    if (!r.has_value() && conn_.broken()) {
      return r.error().WithContext(fmt::format("waiting for {}", peer()));
    }
    if (!r.has_value()) {  // the whole frame failed: every op in it gets the error
      Status err = r.error().WithContext(peer());
      for (const Op& op : f.ops) PushDone({op.user_data, err});
      Retire(it);
      return Status::Ok();
    }
    if (!f.batch) {
      const Op& op = f.ops[0];
      if (!r->in_place) {
        return ProtocolError(fmt::format("{} answered a {}-byte {} with {} bytes", peer(),
                                         op.length, op.type == OpType::kRead ? "READ" : "WRITE",
                                         r->body_len));
      }
      Account(op);
      PushDone({op.user_data, Status::Ok()});
      Retire(it);
      return Status::Ok();
    }
    codes_.resize(f.ops.size());
    if (r->in_place) {
      // Every read succeeded (the body has all their data); a write may still have failed.
      if (Status s = wire::DecodeBatchReplyTable(staging_, codes_); !s.ok()) {
        return s.WithContext(peer());
      }
    } else {
      // Some read failed: its data is absent. The table says which.
      if (r->body_len < table) return ProtocolError(fmt::format("{}: short BATCH reply", peer()));
      FARMEM_RETURN_IF_ERROR(conn_.ReadBody(staging_));
      if (Status s = wire::DecodeBatchReplyTable(staging_, codes_); !s.ok()) {
        return s.WithContext(peer());
      }
      iov_.clear();
      uint64_t data = 0;
      for (size_t i = 0; i < f.ops.size(); ++i) {
        if (codes_[i] == 0 && f.ops[i].type == OpType::kRead) {
          iov_.push_back({f.ops[i].local, f.ops[i].length});
          data += f.ops[i].length;
        }
      }
      if (r->body_len != table + data) {
        return ProtocolError(fmt::format("{}: BATCH reply of {} bytes, expected {}", peer(),
                                         r->body_len, table + data));
      }
      FARMEM_RETURN_IF_ERROR(conn_.ReadBodyV(iov_.data(), static_cast<int>(iov_.size())));
    }
    for (size_t i = 0; i < f.ops.size(); ++i) CompleteBatchOp(f.ops[i], codes_[i]);
    Retire(it);
    return Status::Ok();
  }

  void Retire(std::vector<InFlight>::iterator it) {
    inflight_ops_ -= it->ops.size();
    spare_ops_.push_back(std::move(it->ops));
    inflight_.erase(it);
  }

  // done_ is consumed from done_head_; its room is reused once it is drained.
  void PushDone(Completion c) {
    if (done_head_ > 0 && (done_head_ == done_.size() || done_.size() == done_.capacity())) {
      done_.erase(done_.begin(), done_.begin() + static_cast<ptrdiff_t>(done_head_));
      done_head_ = 0;
    }
    done_.push_back(std::move(c));
  }

  void CompleteBatchOp(const Op& op, uint16_t code) {
    if (code == 0) {
      Account(op);
      PushDone({op.user_data, Status::Ok()});
      return;
    }
    PushDone(
        {op.user_data, Status(StatusCodeFromWire(code),
                              fmt::format("{}: {} of {} bytes at offset {} of lease {:#x} failed",
                                          peer(), op.type == OpType::kRead ? "read" : "write",
                                          op.length, op.offset, op.slab.lease_id))});
  }

  void Account(const Op& op) {
    ++stats_.ops;
    (op.type == OpType::kRead ? stats_.bytes_read : stats_.bytes_written) += op.length;
  }

  size_t Drain(std::span<Completion> out) {
    size_t n = 0;
    while (n < out.size() && done_head_ < done_.size()) out[n++] = std::move(done_[done_head_++]);
    if (done_head_ == done_.size()) {
      done_.clear();
      done_head_ = 0;
    }
    return n;
  }

  // The stream can no longer be trusted: everything outstanding completes with `why`.
  void Break(Status why) {
    if (broken_.ok()) broken_ = std::move(why);
    for (InFlight& f : inflight_) {
      for (const Op& op : f.ops) PushDone({op.user_data, broken_});
    }
    inflight_.clear();
    inflight_ops_ = 0;
    for (const Op& op : pending_) PushDone({op.user_data, broken_});
    pending_.clear();
    conn_.Shutdown();
  }

  TcpConnection conn_;
  ChannelOptions options_;
  std::vector<Op> pending_;
  static constexpr size_t kReserved = 1024;
  std::vector<InFlight> inflight_;
  std::vector<std::vector<Op>> spare_ops_;  // retired frames' op lists, reused
  size_t inflight_ops_ = 0;
  std::vector<Completion> done_;
  size_t done_head_ = 0;          // done_[done_head_..] are not drained yet
  std::vector<uint8_t> staging_;  // a request's descriptors, then a reply's status table
  std::vector<iovec> iov_;
  std::vector<uint16_t> codes_;
  Status broken_;
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
