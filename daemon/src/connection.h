// Connection: one authenticated client connection to farmemd, served start to finish by one
// thread. (The HELLO/AUTH exchange before it happens in the admission loop: handshake.h.)
//
// Reads frames into a receive buffer, decodes and validates each one (docs/wire-protocol.md),
// and answers it. Write payloads that have not yet arrived are received straight into slab
// memory; read replies are sent straight from slab memory with scatter-gather I/O. Bad input is
// answered with an error reply; input that breaks the framing (bad magic, version, oversized
// body) is answered once and the connection is closed. Nothing a bad frame carries is written
// anywhere but the lease it is allowed to touch.
//
// Compaction offload (PARITY_ENCODE, GATHER_CELL) makes this thread a client of other daemons
// for a while: the computation is Offload's (offload.h); this class only frames it.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/socket.h"
#include "farmem/common/wire.h"
#include "handshake.h"
#include "offload.h"
#include "slab_pool.h"

namespace farmem::daemon {

class Server;

class Connection {
 public:
  // `early`: bytes the client sent after the frame that authenticated it (its first requests).
  // Counts the client as connected (STAT) from here on.
  // `handshake` says who the client proved to be: every lease operation acts as its owner().
  Connection(Server* server, Socket socket, std::string peer, const Handshake& handshake,
             std::span<const uint8_t> early);
  ~Connection();
  void Serve();     // runs until the peer leaves, the framing breaks, or Shutdown()
  void Shutdown();  // from another thread: unblocks Serve()

  // Eviction notices (reclaimer.h). From any thread: `frame` (a whole PUSH frame) goes out
  // ahead of the next replies this connection sends.
  // The lease owner this connection acts as (auth::LeaseOwner of identity and client id).
  const wire::ClientId& owner() const { return owner_; }
  const std::string& identity() const { return identity_; }
  bool is_control() const { return control_.load(std::memory_order_relaxed); }
  void QueuePush(std::vector<uint8_t> frame) EXCLUDES(push_mu_);

 private:
  enum class Next { kContinue, kNeedMore, kClose };

  void ServeFrames();
  Next HandleFrame();
  Next HandleControl(const wire::FrameHeader& h, std::span<const uint8_t> body);
  Next HandleRead(const wire::FrameHeader& h, std::span<const uint8_t> body);
  Next HandleWrite(const wire::FrameHeader& h);
  Next HandleBatch(const wire::FrameHeader& h);
  // A daemon-to-daemon offload request (decoded into `req`): the replies already owed go out
  // first (it may take a while and blocks this connection's thread), then the reply body `run`
  // made (empty for PARITY_ENCODE) or its error.
  template <typename Req>
  Next HandleOffload(const wire::FrameHeader& h, const char* name, Result<Req> req,
                     Status (Offload::*run)(const Req&, std::vector<uint8_t>*));

  // Moves `len` payload bytes into dst (nullptr: discard): first what is buffered, then straight
  // from the socket. False if the connection broke.
  bool TakePayload(uint8_t* dst, uint64_t len);

  void Reply(const wire::FrameHeader& req, std::span<const uint8_t> body);
  void ReplyError(const wire::FrameHeader& req, const Status& status);
  // Counts (and logs, at most once a second) an operation on a lease of another owner: another
  // identity, or another client id of this one. `status` is the pool's answer.
  void NoteRefusal(const Status& status);
  void AddExternal(const uint8_t* data, size_t len, Pin pin);
  bool FlushReplies();
  void Consume(size_t n) { pos_ += n; }
  size_t Buffered() const { return end_ - pos_; }
  const uint8_t* Cursor() const { return rbuf_.data() + pos_; }

  Server* server_;
  Socket socket_;
  std::string peer_;
  bool counted_client_ = false;
  wire::ClientId client_id_{};  // as the client declared it: a label under its identity
  std::string identity_;        // authenticated (handshake.h)
  wire::ClientId owner_{};      // whose leases this connection may touch
  std::string client_name_;
  // The once-a-second log of lease operations refused for a foreign lease (see NoteForeign).
  Clock::time_point foreign_logged_{};
  uint64_t foreign_unlogged_ = 0;
  // When the frame at the front of rbuf_ must have arrived in full (set when its first bytes do).
  Deadline frame_deadline_ = kNoDeadline;

  std::vector<uint8_t> rbuf_;
  size_t pos_ = 0, end_ = 0;

  // Replies gathered while processing what one receive brought in; sent together.
  struct Piece {
    size_t offset;        // into wbuf_ when data == nullptr
    const uint8_t* data;  // slab memory (kept valid by a pin)
    size_t len;
  };
  std::vector<uint8_t> wbuf_;
  std::vector<Piece> pieces_;
  std::vector<Pin> pins_;
  std::vector<iovec> iov_;
  std::vector<uint8_t> scratch_;
  std::vector<uint8_t> body_;

  // The client heartbeats or allocates here: eviction notices for it come on this connection.
  std::atomic<bool> control_{false};
  Mutex push_mu_;
  std::vector<std::vector<uint8_t>> pushes_ GUARDED_BY(push_mu_);

  // PARITY_ENCODE and GATHER_CELL, for this connection's client.
  Offload offload_;
};

}  // namespace farmem::daemon
