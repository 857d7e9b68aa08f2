// A blocking, authenticated, framed request/reply connection to a farmemd over TCP: the one
// place where farmem frames are sent and replies are read and matched on the client side.
//
// Used for the control plane (STAT, ALLOC, FREE, HEARTBEAT) by client/, underneath the TCP data
// channel, by farmemd reading its peers (PeerReader) and by farptr's offload requests.
// Connect() performs HELLO and, when a secret is configured, the mutual challenge-response AUTH
// (docs/wire-protocol.md).
//
// Two ways to use it:
//  - Call(): one request, one reply.
//  - Send() / Receive(): pipelined. Send() returns the request's id at once; Receive(id) waits
//    for that reply. Replies may come back in any order: one that arrives before its turn is
//    kept until its Receive. A reply whose layout the caller knows (a READ's data, a BATCH's
//    status table and read data) lands where the caller says in one recvmsg.
// Any failure of the byte stream (I/O error, timeout, a frame that is not a reply to an
// outstanding request) breaks the connection for good: broken() is true and every later call
// fails. An error status a daemon answers with is that request's result; the connection stays.
//
// Not thread-safe: one thread at a time (client/ wraps it in a mutex; a data channel and
// farmemd's PeerReader belong to one thread).
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "farmem/common/socket.h"
#include "farmem/common/wire.h"
#include "farmem/transport/transport.h"

namespace farmem::transport {

class TcpConnection {
 public:
  static Result<TcpConnection> Connect(const ChannelOptions& options);

  TcpConnection(TcpConnection&&) = default;
  TcpConnection& operator=(TcpConnection&&) = default;

  // One request, one reply (the reply's error status becomes the returned Status).
  Result<std::vector<uint8_t>> Call(wire::Opcode op, std::span<const uint8_t> body,
                                    std::chrono::milliseconds timeout);

  // ---- pipelined requests ----

  // Sends one request frame whose body is `body` (SendV: the iovecs' bytes in order, sent
  // straight from them). Returns the id to Receive the reply with. Every request sent is
  // received, or the connection dropped: a reply nobody takes is kept until then.
  Result<uint64_t> Send(wire::Opcode op, std::span<const uint8_t> body, Deadline deadline);
  Result<uint64_t> SendV(wire::Opcode op, std::span<const iovec> body, Deadline deadline);

  struct Reply {
    uint32_t body_len = 0;
    // True: the body is in `dst`. False: the body (body_len bytes, another size than dst's) is
    // still to be taken with ReadBody/ReadBodyV; what the caller leaves is dropped by the next
    // Receive.
    bool in_place = false;
  };
  // Waits for the reply to request `id`. `dst` is where its body goes when the request succeeded
  // (status 0) with exactly dst's size in bytes — the layout the caller expects on success.
  // Returns the reply's error status as an error without breaking the connection (broken() tells
  // such an answer from a failure of the connection).
  Result<Reply> Receive(uint64_t id, std::span<uint8_t> dst, Deadline deadline);
  Result<Reply> ReceiveV(uint64_t id, std::span<const iovec> dst, Deadline deadline);
  // The next out.size() bytes of the body of the reply Receive returned not in place.
  Status ReadBody(std::span<uint8_t> out);
  Status ReadBodyV(iovec* iov, int iovcnt);  // advances the array as it goes

  // A request whose reply has already been received (ahead of its turn) and is kept here.
  std::optional<uint64_t> ArrivedReply() const;
  // Bytes of a frame are already received and kept here: polling pollable_fd() would not
  // announce them.
  bool buffered() const { return carry_pos_ < carry_.size(); }
  // Whether a Receive could make progress now without waiting (something is kept here, or the
  // socket has bytes or an error to report).
  bool ReplyWaiting() const;
  // Bounds every receive made with kNoDeadline (the data path: one syscall per receive instead
  // of poll()+recv); such a receive then fails with DeadlineExceeded.
  Status SetReceiveTimeout(std::chrono::milliseconds timeout);
  // For poll(2) only, to learn when a reply may be arriving; -1 once broken.
  int pollable_fd() const { return broken_ ? -1 : socket_.fd(); }

  std::vector<std::vector<uint8_t>> TakePushes();  // bodies of EVICT_NOTICE pushes received

  const wire::HelloReply& hello() const { return hello_; }
  const Endpoint& endpoint() const { return endpoint_; }
  bool broken() const { return broken_; }
  // Unblocks a thread stuck in a receive (used on shutdown).
  void Shutdown() { socket_.Shutdown(); }

 private:
  // A request sent and not yet received by Receive.
  struct Outstanding {
    uint64_t id = 0;
    uint8_t opcode = 0;
    bool arrived = false;  // its reply came ahead of its turn: status and body are below
    uint16_t status = 0;
    std::vector<uint8_t> body;
  };
  // Unsolicited frames kept for TakePushes at the most; older ones are dropped.
  static constexpr size_t kMaxKeptPushes = 64;
  // Requests outstanding that outstanding_ has room for from the first request on: a channel's
  // frames in flight, at most its max_outstanding operations (64 by default, ChannelOptions).
  static constexpr size_t kReservedOutstanding = 64;

  TcpConnection() = default;
  Status Handshake(const ChannelOptions& options);

  Status Fail(Status why);  // breaks the connection, returns why
  std::vector<Outstanding>::iterator Find(uint64_t id);
  // The largest success reply body to a request of this opcode.
  static uint32_t MaxReplyBody(uint8_t opcode);
  // The reply kept for `it` (which has arrived), handed out as Receive does.
  Result<Reply> TakeArrived(std::vector<Outstanding>::iterator it, std::span<const iovec> dst);
  // One recvmsg into [header, dst]: true if it was the expected reply to `id`, now complete;
  // false with another header in `hdr` and what followed it kept in carry_.
  Result<bool> ReceiveExpected(uint64_t id, uint8_t opcode, std::span<const iovec> dst,
                               uint64_t dst_len, uint8_t* hdr, Deadline deadline);
  // Exactly the iovecs' bytes of the stream: first what carry_ holds, then the socket.
  Status RecvStream(iovec* iov, int iovcnt, Deadline deadline);
  Status RecvStream(std::span<uint8_t> out, Deadline deadline);
  Status DropBody();  // the rest of a body the caller did not take

  Socket socket_;
  Endpoint endpoint_;
  wire::HelloReply hello_;
  uint64_t next_request_id_ = 0;
  bool broken_ = false;
  std::vector<Outstanding> outstanding_;
  std::vector<std::vector<uint8_t>> pushes_;
  std::vector<uint8_t> carry_;  // received, not yet consumed (see ReceiveExpected)
  size_t carry_pos_ = 0;
  // The body of the reply Receive returned not in place: body_left_ bytes of it are still to
  // be read, from the stream or (when it arrived ahead of its turn) from taken_.
  uint32_t body_left_ = 0;
  bool body_from_taken_ = false;
  std::vector<uint8_t> taken_;
  size_t taken_pos_ = 0;
  Deadline body_deadline_{};
  uint8_t send_header_[wire::kHeaderSize] = {};
  std::vector<iovec> iov_;
  std::vector<uint8_t> scratch_;
  std::chrono::milliseconds rcv_timeout_{0};
};

}  // namespace farmem::transport
