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
// and never blocks on the socket while replies are waiting to be sent. A backend that finishes
// some requests of a batch before the others (the remote page store, as each daemon answers)
// reports them through BatchListener; their replies go out at once, one sendmsg() per wait of the
// backend, so that the client can reuse those slots while the rest of the batch is in flight.
// Buffers are allocated once when the connection enters transmission:
//   in_   receive buffer (kInBufferSize): request headers and the payload of small writes, which
//         the backend reads in place;
//   data_ kMaxPayload bytes: read data of a batch, or the payload of a write too big for in_.
#pragma once

#include <sys/uio.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "farmem/blockdev/block_backend.h"
#include "farmem/blockdev/nbd_protocol.h"

namespace farmem::blockdev {

class NbdConnection final : private BatchListener {
 public:
  NbdConnection(int fd, std::string peer, BlockBackend* backend, const nbd::ExportInfo* info,
                std::chrono::milliseconds handshake_timeout);
  // Serves the connection until the client disconnects, violates the protocol, or the socket is
  // shut down by the server. Never throws.
  void Run();

 private:
  static constexpr size_t kInBufferSize = 1u << 20;
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
  // Handles a WRITE whose payload does not fit in in_: its header is at in_start_.
  bool HandleLargeWrite(const nbd::Request& r, const nbd::RequestCheck& check);
  // Runs ops_[0..n) and sends the replies for pending_[0..count).
  bool Complete(size_t count, size_t n_ops);
  // Sends the replies of pending_[0..count) not sent yet (plus any early ones still queued).
  bool SendReplies(size_t count);
  // Appends the reply of pending_[i] to iov_ (at most two entries).
  void AppendReply(size_t i);
  bool SendAllIov(iovec* iov, int n);
  // BatchListener: replies of requests the backend finished before the rest of the batch.
  void OpDone(size_t op) override;
  void Progress() override;
  // NBD error number for a backend failure.
  static uint32_t NbdError(const Status& s, const nbd::Request& r);

  const int fd_;
  const std::string peer_;
  BlockBackend* const backend_;
  const nbd::ExportInfo* const info_;
  const std::chrono::milliseconds handshake_timeout_;
  nbd::Session session_;

  std::unique_ptr<uint8_t[]> in_;
  size_t in_start_ = 0;  // first unconsumed byte
  size_t in_end_ = 0;    // end of received bytes
  std::unique_ptr<uint8_t[]> data_;

  std::unique_ptr<std::array<Pending, kMaxBatch>> pending_;
  std::unique_ptr<std::array<BlockOp, kMaxBatch>> ops_;
  std::unique_ptr<std::array<std::array<uint8_t, kReplyHeaderMax>, kMaxBatch>> headers_;
  std::unique_ptr<std::array<iovec, kMaxIov>> iov_;
  int iov_used_ = 0;  // entries of iov_ queued for the next send
  std::unique_ptr<std::array<uint16_t, kMaxBatch>> op_pending_;  // ops_ index -> pending_ index
  bool send_failed_ = false;

  uint64_t requests_ = 0;
  uint64_t batches_ = 0;
  uint64_t early_replies_ = 0;
  uint64_t failed_requests_ = 0;
  const char* end_reason_ = "client disconnected";
};

}  // namespace farmem::blockdev
