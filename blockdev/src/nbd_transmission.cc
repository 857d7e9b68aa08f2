// The NBD request path: batches of requests run to completion on the connection's thread.
// See nbd_connection.h for the buffer layout and the loop; nothing here allocates except when
// logging a failure.
#include <errno.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "farmem/common/log_every.h"
#include "farmem/common/socket.h"
#include "nbd_connection.h"

namespace farmem::blockdev {

using nbd::kRequestHeaderSize;

void NbdConnection::Transmit() {
  in_ = std::make_unique_for_overwrite<uint8_t[]>(kInBufferSize);
  data_ = std::make_unique_for_overwrite<uint8_t[]>(kDataBufferSize);
  pending_ = std::make_unique<std::array<Pending, kMaxBatch>>();
  ops_ = std::make_unique<std::array<BlockOp, kMaxBatch>>();
  headers_ = std::make_unique<std::array<std::array<uint8_t, kReplyHeaderMax>, kMaxBatch>>();
  iov_ = std::make_unique<std::array<iovec, kMaxIov>>();
  iov_sent_ = iov_used_ = 0;
  op_pending_ = std::make_unique<std::array<uint16_t, kMaxBatch>>();
  in_start_ = in_end_ = 0;

  for (;;) {
    // The reply queue is empty here (SendReplies drained it), so blocking on the socket is fine.
    if (!Fill(kRequestHeaderSize)) return;
    if (metrics_ != nullptr) batch_start_ = std::chrono::steady_clock::now();

    size_t count = 0;    // requests in this batch
    size_t n_ops = 0;    // of which run on the backend
    uint64_t arena = 0;  // bytes of data_ promised to reads of this batch
    bool disconnect = false;
    bool violation = false;
    bool large_read = false;  // the first request is a READ longer than data_
    size_t pos = in_start_;
    while (count < kMaxBatch) {
      const nbd::Framing f = nbd::NextFrame({in_.get() + pos, in_end_ - pos});
      if (f.kind == nbd::Framing::kNeedMore) break;
      if (f.kind == nbd::Framing::kBadMagic) {
        violation = true;
        break;
      }
      const nbd::Request& r = f.request;
      const nbd::RequestCheck check = nbd::CheckRequest(r, session_);
      if (check.disconnect) {
        disconnect = true;
        pos += kRequestHeaderSize;
        break;
      }
      if (f.payload > in_end_ - pos - kRequestHeaderSize) break;  // payload still on its way
      if (check.error == 0 && r.type == nbd::kCmdRead && arena + r.length > kDataBufferSize) {
        large_read = count == 0;
        break;  // data_ is full; this read starts the next batch
      }
      Pending& p = (*pending_)[count++];
      p = Pending{.request = r, .error = check.error, .message = check.message};
      if (check.error == 0) {
        BlockOp& op = (*ops_)[n_ops];
        (*op_pending_)[n_ops] = static_cast<uint16_t>(count - 1);
        p.op = static_cast<int>(n_ops++);
        op.status = Status::Ok();
        op.fua = (r.flags & nbd::kCmdFlagFua) != 0;
        op.may_trim = (r.flags & nbd::kCmdFlagNoHole) == 0;
        op.offset = r.offset;
        op.length = r.length;
        op.read_into = {};
        op.data = {};
        switch (r.type) {
          case nbd::kCmdRead:
            op.kind = BlockOp::Kind::kRead;
            op.read_into = {data_.get() + arena, r.length};
            arena += r.length;
            break;
          case nbd::kCmdWrite:
            op.kind = BlockOp::Kind::kWrite;
            op.data = {in_.get() + pos + kRequestHeaderSize, r.length};  // read in place
            break;
          case nbd::kCmdFlush:
            op.kind = BlockOp::Kind::kFlush;
            break;
          case nbd::kCmdTrim:
            op.kind = BlockOp::Kind::kTrim;
            break;
          case nbd::kCmdWriteZeroes:
            op.kind = BlockOp::Kind::kWriteZeroes;
            break;
          default:  // CheckRequest accepts nothing else
            p.op = -1;
            --n_ops;
            p.error = nbd::kEinval;
            p.message = "unknown command";
            break;
        }
      }
      pos += kRequestHeaderSize + f.payload;
    }

    if (count == 0 && !disconnect && !violation) {
      // The first request is a READ longer than data_, or a WRITE whose payload has not fully
      // arrived.
      nbd::Request r;
      nbd::DecodeRequestHeader({in_.get() + in_start_, in_end_ - in_start_}, &r);
      if (large_read) {
        if (!HandleLargeRead(r)) return;
        continue;
      }
      const nbd::RequestCheck check = nbd::CheckRequest(r, session_);
      const uint64_t need = kRequestHeaderSize + uint64_t{r.length};
      if (need <= kInBufferSize) {
        if (!Fill(need)) return;
      } else if (!HandleLargeWrite(r, check)) {
        return;
      }
      continue;
    }

    // The write payloads of this batch live in in_[in_start_, pos): consume only after running.
    if (!Complete(count, n_ops)) return;
    in_start_ = pos;
    if (violation) {
      end_reason_ = "bad request magic (protocol violation)";
      return;
    }
    if (disconnect) {
      end_reason_ = "client sent NBD_CMD_DISC";
      // A client that leaves cleanly gets its writes made durable, as if it had flushed (the
      // backend may cache writes: the farmem backend's write cache).
      if (Status s = backend_->Flush(); !s.ok()) {
        spdlog::warn("nbd: {}: flush at disconnect failed: {}", peer_, s.ToString());
      }
      return;
    }
  }
}

bool NbdConnection::Fill(size_t n) {
  if (in_start_ == in_end_) in_start_ = in_end_ = 0;
  if (in_end_ - in_start_ >= n) return true;
  if (in_start_ + n > kInBufferSize || in_start_ > kInBufferSize / 2) {
    std::memmove(in_.get(), in_.get() + in_start_, in_end_ - in_start_);
    in_end_ -= in_start_;
    in_start_ = 0;
  }
  while (in_end_ - in_start_ < n) {
    // A short spin first (when configured): a client that keeps its queue full sends again
    // within µs, and a sleeping thread costs it a wake-up. What the spin's recv returns (data,
    // end of stream, an error) is handled below as the blocking recv's would be.
    ssize_t got = -1;
    int err = 0;
    const bool caught = request_spin_.Spin([&] {
      got = ::recv(fd_, in_.get() + in_end_, kInBufferSize - in_end_, MSG_DONTWAIT);
      err = errno;
      return got >= 0 || (err != EAGAIN && err != EWOULDBLOCK && err != EINTR) ? 1 : 0;
    }) > 0;
    // What the spin did, as it happens (a connection lives long); nothing when it did nothing
    // (the budget is 0): hits change only with spins.
    if (const AdaptiveSpin::Stats& st = request_spin_.stats();
        metrics_ != nullptr &&
        (st.spins != spin_counted_.spins || st.skipped != spin_counted_.skipped)) {
      metrics_->request_spins->Add(st.spins - spin_counted_.spins);
      metrics_->request_spin_hits->Add(st.hits - spin_counted_.hits);
      metrics_->request_spin_skips->Add(st.skipped - spin_counted_.skipped);
      spin_counted_ = st;
    }
    if (!caught) {
      got = ::recv(fd_, in_.get() + in_end_, kInBufferSize - in_end_, 0);
      err = errno;
    }
    if (got > 0) {
      in_end_ += static_cast<size_t>(got);
    } else if (got == 0) {
      if (in_end_ != in_start_) end_reason_ = "client disconnected in the middle of a request";
      return false;
    } else if (err != EINTR) {
      end_reason_ = "receive failed";
      return false;
    }
  }
  return true;
}

bool NbdConnection::HandleLargeWrite(const nbd::Request& r, const nbd::RequestCheck& check) {
  in_start_ += kRequestHeaderSize;
  Pending& p = (*pending_)[0];
  p = Pending{.request = r, .error = check.error, .message = check.message};
  // The op stands for the whole request in the reply (AppendReply); each piece runs as an op of
  // its own. After a piece fails the rest of the payload is only read (it is still part of the
  // stream) and the request fails with that piece's status.
  BlockOp& whole = (*ops_)[0];
  whole = BlockOp{};
  whole.kind = BlockOp::Kind::kWrite;
  whole.offset = r.offset;
  whole.length = r.length;
  for (uint64_t done = 0; done < r.length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(r.length - done, kInBufferSize));
    if (!Fill(n)) {
      end_reason_ = "client disconnected in the middle of a write payload";
      return false;
    }
    if (check.error == 0 && whole.status.ok()) {
      // FUA on every piece: the reply says the whole request is durable.
      BlockOp piece{};
      piece.kind = BlockOp::Kind::kWrite;
      piece.fua = (r.flags & nbd::kCmdFlagFua) != 0;
      piece.offset = r.offset + done;
      piece.length = n;
      piece.data = {in_.get() + in_start_, n};
      backend_->ExecuteBatch({&piece, 1});
      whole.status = std::move(piece.status);
    }
    in_start_ += n;
    done += n;
  }
  if (check.error != 0) return Complete(1, 0);
  p.op = 0;
  (*op_pending_)[0] = 0;
  requests_ += 1;
  ++batches_;
  return SendReplies(1);
}

bool NbdConnection::HandleLargeRead(const nbd::Request& r) {
  in_start_ += kRequestHeaderSize;
  ++requests_;
  uint8_t* h = (*headers_)[0].data();
  // One header, then the data piece by piece: a simple reply, or a structured one whose client
  // asked for a single chunk (DF, which we advertise).
  const bool one_header = !session_.structured_replies || (r.flags & nbd::kCmdFlagDf) != 0;
  for (uint64_t done = 0; done < r.length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(r.length - done, kDataBufferSize));
    BlockOp op{};
    op.kind = BlockOp::Kind::kRead;
    op.offset = r.offset + done;
    op.length = n;
    op.read_into = {data_.get(), n};
    backend_->ExecuteBatch({&op, 1});
    ++batches_;
    iovec* iov = iov_->data();
    if (!op.status.ok()) {
      const char* message = nullptr;
      const uint32_t error = BackendFailed(r, op.status, &message);
      CountReply(r, error, message);
      if (done > 0 && one_header) {
        // The header, sent with the first piece, said success: the only way left to tell the
        // client is to end the connection before the rest of the data.
        end_reason_ = "a read failed after part of its reply was sent";
        return false;
      }
      AppendError(h, r, error, message);
      return Drain();
    }
    const bool last = done + n == r.length;
    if (!one_header) {
      nbd::EncodeOffsetDataHeader(h, r.handle, op.offset, static_cast<uint32_t>(n), last);
      iov[iov_used_++] = {h, nbd::kOffsetDataHeaderSize};
    } else if (done == 0 && session_.structured_replies) {
      nbd::EncodeOffsetDataHeader(h, r.handle, r.offset, r.length);
      iov[iov_used_++] = {h, nbd::kOffsetDataHeaderSize};
    } else if (done == 0) {
      nbd::EncodeSimpleReply(h, 0, r.handle);
      iov[iov_used_++] = {h, nbd::kSimpleReplySize};
    }
    iov[iov_used_++] = {data_.get(), n};
    if (last) CountReply(r, 0, "");
    if (!Drain()) return false;
    done += n;
  }
  return true;
}

bool NbdConnection::Complete(size_t count, size_t n_ops) {
  if (n_ops > 0) backend_->ExecuteBatch({ops_->data(), n_ops}, this);
  requests_ += count;
  ++batches_;
  return SendReplies(count);
}

void NbdConnection::OpDone(size_t op) {
  const size_t i = (*op_pending_)[op];
  AppendReply(i);
  (*pending_)[i].replied = true;
  ++early_replies_;
}

void NbdConnection::Progress() {
  // Offer, never wait: the batch holds extent locks and has remote operations in flight. A failed
  // send ends the connection after the batch (SendReplies sees send_failed_).
  reply_time_.reset();  // replies queued after this are stamped anew
  if (!send_failed_) (void)TrySend();
}

uint32_t NbdConnection::NbdError(const Status& s, const nbd::Request& r) {
  switch (s.code()) {
    case StatusCode::kOutOfRange:
      return r.type == nbd::kCmdRead ? nbd::kEinval : nbd::kEnospc;
    case StatusCode::kResourceExhausted:
      return nbd::kEnospc;
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnimplemented:
      return nbd::kEinval;
    case StatusCode::kPermissionDenied:
      return nbd::kEperm;
    case StatusCode::kAborted:
      return nbd::kEshutdown;
    default:
      return nbd::kEio;  // the data could not be produced or stored
  }
}

bool NbdConnection::SendReplies(size_t count) {
  reply_time_.reset();  // the batch is done: its remaining replies are stamped now
  for (size_t i = 0; i < count; ++i) {
    if (!(*pending_)[i].replied) AppendReply(i);
  }
  return Drain();
}

bool NbdConnection::Drain() {
  reply_time_.reset();  // replies queued after this are stamped anew
  // The common case: the socket takes every reply of the batch in one sendmsg().
  if (send_failed_ || !TrySend()) {
    send_failed_ = false;
    return false;
  }
  if (iov_sent_ == iov_used_) return true;
  // The client is not keeping up. Wait for it here, outside the backend, reading no new requests
  // (their replies would have nowhere to go), but not forever.
  const auto deadline = *refused_since_ + reply_timeout_;
  iovec* iov = iov_->data() + iov_sent_;
  int n = iov_used_ - iov_sent_;
  size_t queued = 0;
  for (int i = 0; i < n; ++i) queued += iov[i].iov_len;
  const Status s = SendAll(fd_, iov, n, deadline);
  iov_sent_ = iov_used_ = 0;
  refused_since_.reset();
  if (s.ok()) return true;
  if (s.code() == StatusCode::kDeadlineExceeded) {
    spdlog::warn(
        "nbd: {} did not read its replies: {} bytes were still queued {} ms after the socket "
        "first refused them; dropping the connection (--reply-timeout)",
        peer_, queued, reply_timeout_.count());
    end_reason_ = "the client did not read its replies (--reply-timeout)";
  } else {
    end_reason_ = "send failed (client gone?)";
  }
  return false;
}

bool NbdConnection::TrySend() {
  while (iov_sent_ < iov_used_) {
    msghdr msg{};
    msg.msg_iov = iov_->data() + iov_sent_;
    msg.msg_iovlen = static_cast<size_t>(iov_used_ - iov_sent_);
    const ssize_t sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!refused_since_) {
          refused_since_ = std::chrono::steady_clock::now();
          ++reply_stalls_;
        }
        return true;
      }
      end_reason_ = "send failed (client gone?)";
      send_failed_ = true;
      return false;
    }
    iovec* iov = iov_->data() + iov_sent_;
    int left = iov_used_ - iov_sent_;
    AdvanceIov(iov, left, static_cast<size_t>(sent));
    iov_sent_ = iov_used_ - left;
  }
  // Everything offered was taken: later replies of the batch start the queue afresh.
  iov_sent_ = iov_used_ = 0;
  refused_since_.reset();
  return true;
}

void NbdConnection::AppendReply(size_t i) {
  iovec* iov = iov_->data();
  int& n = iov_used_;
  const Pending& p = (*pending_)[i];
  const nbd::Request& r = p.request;
  uint8_t* h = (*headers_)[i].data();
  uint32_t error = p.error;
  const char* message = p.message;
  std::span<uint8_t> read_data;
  if (p.op >= 0) {
    const BlockOp& op = (*ops_)[static_cast<size_t>(p.op)];
    if (!op.status.ok()) {
      error = BackendFailed(r, op.status, &message);
    } else if (r.type == nbd::kCmdRead) {
      read_data = op.read_into;
    }
  }
  CountReply(r, error, message);
  if (error != 0) return AppendError(h, r, error, message);
  if (r.type != nbd::kCmdRead) {
    nbd::EncodeSimpleReply(h, 0, r.handle);
    iov[n++] = {h, nbd::kSimpleReplySize};
    return;
  }
  // With structured replies a READ must get a structured reply.
  if (session_.structured_replies) {
    nbd::EncodeOffsetDataHeader(h, r.handle, r.offset, r.length);
    iov[n++] = {h, nbd::kOffsetDataHeaderSize};
  } else {
    nbd::EncodeSimpleReply(h, 0, r.handle);
    iov[n++] = {h, nbd::kSimpleReplySize};
  }
  iov[n++] = {read_data.data(), read_data.size()};
}

void NbdConnection::AppendError(uint8_t* h, const nbd::Request& r, uint32_t error,
                                const char* message) {
  iovec* iov = iov_->data();
  if (session_.structured_replies) {
    // Errors of every command get a structured reply so that the message reaches the user.
    const uint16_t len = nbd::ErrorMessageLength(message);
    nbd::EncodeErrorChunkHeader(h, r.handle, error, len);
    iov[iov_used_++] = {h, nbd::kErrorChunkFixedSize};
    if (len > 0) iov[iov_used_++] = {const_cast<char*>(message), len};
  } else {
    nbd::EncodeSimpleReply(h, error, r.handle);
    iov[iov_used_++] = {h, nbd::kSimpleReplySize};
  }
}

uint32_t NbdConnection::BackendFailed(const nbd::Request& r, const Status& s,
                                      const char** message) {
  *message = "the storage backend failed";
  // At most a line every 5 s (a client reading a lost range sector by sector fails thousands of
  // requests a second); the store's LOST lines say what is lost.
  static LogEvery log(std::chrono::seconds(5));
  uint64_t left_out = 0;
  if (log.Allow(&left_out)) {
    spdlog::warn("nbd: {}: {} of {} bytes at {} failed: {}{}", peer_, nbd::CommandName(r.type),
                 r.length, r.offset, s.ToString(), Suppressed(left_out));
  }
  return NbdError(s, r);
}

void NbdConnection::CountReply(const nbd::Request& r, uint32_t error, const char* message) {
  if (metrics_ != nullptr) {
    const NbdMetrics::Command c = NbdMetrics::CommandOf(r.type);
    metrics_->requests[c]->Add();
    if (error != 0) {
      metrics_->errors[c]->Add();
    } else {
      metrics_->bytes[c]->Add(r.length);
    }
    metrics_->latency[c]->Observe(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(ReplyTime() - batch_start_).count()));
  }
  if (error != 0) {
    ++failed_requests_;
    spdlog::debug("nbd: {}: {} offset {} length {} flags 0x{:x}: error {} ({})", peer_,
                  nbd::CommandName(r.type), r.offset, r.length, r.flags, error, message);
  }
}

}  // namespace farmem::blockdev
