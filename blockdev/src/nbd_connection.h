// NbdConnection: one client connection, from greeting to close. Private to blockdev/.
//
// Owned by (and only ever touched from) its connection thread; the socket fd is borrowed from the
// server's ConnectionSlot, which closes it after this thread has been joined.
//
// Setup (greeting, option haggling) is in nbd_connection.cc; the request path is in
// nbd_transmission.cc. The request path runs each batch to completion on this thread:
//
//   recv() everything available  ->  split into requests (NextFrame/CheckRequest)
//   -> backend->ExecuteBatch()   ->  one sendmsg() with every reply of the batch
//
// A backend that finishes some requests of a batch before the others (the remote page store, as
// each daemon answers) reports them through BatchListener; their replies go out at once, one
// sendmsg() per wait of the backend, so that the client can reuse those slots while the rest of
// the batch is in flight.
//
// The reply queue, and why the batch never waits on the client. Replies are iovecs queued in
// iov_ (headers in headers_, read data in data_); the queue holds the replies of one batch at most
// (kMaxBatch replies, kDataBufferSize bytes of data). Inside ExecuteBatch (OpDone/Progress)
// replies are only queued and offered to the socket with non-blocking sends: whatever the socket
// does not take stays queued, and the batch goes on. Its extent locks and remote reads must not
// wait for a client, or a client that stops reading would hold up other connections and rebuilds
// and make healthy daemons miss the page store's operation timeout. After the batch, the rest of
// the queue is sent with poll(POLLOUT) between non-blocking sends, and no new request is read
// until it is empty (backpressure: data_ and headers_ are reused by the next batch). If the
// client has not taken the queued replies within reply_timeout of the socket first refusing
// them, the connection is dropped with a log line.
//
// Buffers are allocated once when the connection enters transmission, and are small: under
// --swap-safe every byte of them is locked memory, taken from a host that is short of memory
// (docs/nbd.md, "Memory footprint"). The protocol still allows requests of nbd::kMaxPayload
// (32 MiB); a request larger than its buffer is served in pieces, one after the other:
//   in_   receive buffer (kInBufferSize): request headers and the payload of writes, which the
//         backend reads in place. A write whose payload does not fit is received and written
//         kInBufferSize bytes at a time (HandleLargeWrite), its reply sent after the last piece;
//   data_ kDataBufferSize bytes: read data of a batch. A read longer than data_ is read and sent
//         kDataBufferSize bytes at a time (HandleLargeRead): as several structured-reply data
//         chunks, or one reply (simple, or one chunk for DF) whose data follows piece by piece.
// A batch thus never carries more than kInBufferSize bytes of writes nor kDataBufferSize of reads,
// which bounds the backend's own per-batch buffers too (the page store's sealed pages).
#pragma once

#include <sys/uio.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/nbd_metrics.h"
#include "farmem/blockdev/nbd_protocol.h"
#include "farmem/common/adaptive_spin.h"

namespace farmem::blockdev {

class NbdConnection final : private BatchListener {
 public:
  NbdConnection(int fd, std::string peer, BlockBackend* backend, const nbd::ExportInfo* info,
                NbdMetrics* metrics, std::chrono::milliseconds handshake_timeout,
                std::chrono::milliseconds reply_timeout,
                std::chrono::microseconds request_busy_poll);
  // Serves the connection until the client disconnects, violates the protocol, or the socket is
  // shut down by the server. Never throws.
  void Run();

 private:
  // What the kernel sends to a swap device is at most a few hundred KiB per request (swap-in
  // readahead is 8 pages by default; the block layer splits at max_sectors_kb, 1280 KiB at most
  // by default); a request beyond these is served in pieces of these sizes.
  static constexpr size_t kInBufferSize = 256u << 10;
  static constexpr size_t kDataBufferSize = 1u << 20;
  static constexpr size_t kMaxBatch = 256;
  // Per reply: header, plus data or an error message.
  static constexpr size_t kMaxIov = 2 * kMaxBatch;
  static constexpr size_t kReplyHeaderMax = 32;

  // One request of the current batch, in arrival order.
  struct Pending {
    nbd::Request request;
    uint32_t error = 0;  // validation error, or 0
    const char* message = "";
    int op = -1;           // index into ops_ if the request runs on the backend
    bool replied = false;  // its reply went out early (BatchListener)
  };

  // ---- setup (nbd_connection.cc) ----
  bool Negotiate();

  // ---- request path (nbd_transmission.cc) ----
  void Transmit();
  // Makes at least `n` unconsumed bytes available in in_ (n <= kInBufferSize). False on EOF or
  // error (the connection is over).
  bool Fill(size_t n);
  // Handles a WRITE whose payload does not fit in in_ (its header is at in_start_): received and
  // written in pieces of kInBufferSize, one reply after the last. A refused one (e.g. longer than
  // kMaxPayload) has its payload read and dropped, then the error reply.
  bool HandleLargeWrite(const nbd::Request& r, const nbd::RequestCheck& check);
  // Handles a valid READ longer than data_ (its header is at in_start_): read and sent in pieces
  // of kDataBufferSize. A failure after the first piece went out ends the connection if the
  // reply has one header (simple, or DF: it already said success); otherwise an error chunk
  // ends the reply.
  bool HandleLargeRead(const nbd::Request& r);
  // Runs ops_[0..n) and sends the replies for pending_[0..count).
  bool Complete(size_t count, size_t n_ops);
  // Queues the replies of pending_[0..count) not queued yet, then sends the whole queue, waiting
  // for the client up to the reply deadline. False if the connection must end.
  bool SendReplies(size_t count);
  // Sends the whole reply queue, waiting for the client up to the reply deadline. False if the
  // connection must end.
  bool Drain();
  // Counts the reply to `r` in the metrics and the connection's totals.
  void CountReply(const nbd::Request& r, uint32_t error, const char* message);
  // When metrics_: the time replies queued now are stamped with — one clock read for every reply
  // queued until the queue is next offered to the socket (Drain, Progress), not one per reply.
  std::chrono::steady_clock::time_point ReplyTime() {
    if (!reply_time_) reply_time_ = std::chrono::steady_clock::now();
    return *reply_time_;
  }
  // Appends the reply of pending_[i] to the reply queue (at most two iovecs).
  void AppendReply(size_t i);
  // Appends an error reply to r in header buffer h (at most two iovecs): an error chunk with
  // the message under structured replies, else a simple reply.
  void AppendError(uint8_t* h, const nbd::Request& r, uint32_t error, const char* message);
  // Offers the reply queue to the socket without blocking; what it does not take stays queued.
  // False (and send_failed_) if the send failed.
  bool TrySend();
  // BatchListener: replies of requests the backend finished before the rest of the batch.
  void OpDone(size_t op) override;
  void Progress() override;
  // NBD error number for a backend failure.
  static uint32_t NbdError(const Status& s, const nbd::Request& r);
  // A backend failure of r, logged: its NBD error number; *message is what the client is told.
  uint32_t BackendFailed(const nbd::Request& r, const Status& s, const char** message);

  const int fd_;
  const std::string peer_;
  BlockBackend* const backend_;
  const nbd::ExportInfo* const info_;
  const std::chrono::milliseconds handshake_timeout_;
  const std::chrono::milliseconds reply_timeout_;
  nbd::Session session_;

  std::unique_ptr<uint8_t[]> in_;
  size_t in_start_ = 0;  // first unconsumed byte
  size_t in_end_ = 0;    // end of received bytes
  std::unique_ptr<uint8_t[]> data_;

  std::unique_ptr<std::array<Pending, kMaxBatch>> pending_;
  std::unique_ptr<std::array<BlockOp, kMaxBatch>> ops_;
  std::unique_ptr<std::array<std::array<uint8_t, kReplyHeaderMax>, kMaxBatch>> headers_;
  // The reply queue: iov_[iov_sent_, iov_used_) is still to be sent (the entry at iov_sent_ may
  // be partly sent). Empty (both 0) whenever a batch starts.
  std::unique_ptr<std::array<iovec, kMaxIov>> iov_;
  int iov_sent_ = 0;
  int iov_used_ = 0;
  // When the socket first refused queued replies (it was full); the reply deadline runs from here.
  // Unset while the queue is empty or the socket has taken everything offered.
  std::optional<std::chrono::steady_clock::time_point> refused_since_;
  std::unique_ptr<std::array<uint16_t, kMaxBatch>> op_pending_;  // ops_ index -> pending_ index
  bool send_failed_ = false;
  // Fill's spin for the client's next bytes before it sleeps (NbdServerOptions::request_busy_poll).
  AdaptiveSpin request_spin_;
  AdaptiveSpin::Stats spin_counted_;  // what of request_spin_'s stats metrics_ has been given

  NbdMetrics* const metrics_;                            // null: nothing counted
  std::chrono::steady_clock::time_point batch_start_{};  // when metrics_: the current batch's
  std::optional<std::chrono::steady_clock::time_point> reply_time_;  // ReplyTime's; unset: read
  uint64_t requests_ = 0;
  uint64_t batches_ = 0;
  uint64_t early_replies_ = 0;
  uint64_t failed_requests_ = 0;
  uint64_t reply_stalls_ = 0;  // batches whose replies the socket did not take at once
  const char* end_reason_ = "client disconnected";
};

}  // namespace farmem::blockdev
