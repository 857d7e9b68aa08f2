// The one interface for one-sided remote memory: read and write bytes of a lease on a daemon.
//
// Two implementations hide behind it: `tcp` (framed messages, the daemon copies into/out of its
// slab) and `verbs` (RDMA READ/WRITE on an RC queue pair; the daemon's CPU is not involved).
// Callers (client/, and through it blockdev/ and farptr/) never learn which one they hold.
//
// The model is a queue pair's: Post() queues operations, Flush() rings the doorbell (one writev /
// one ibv_post_send for everything queued), Poll() reaps completions. Read()/Write()/Execute()
// are the synchronous conveniences built on those three.
//
// Threading: a Channel belongs to one thread at a time (no internal locking on the data path).
// Threads that want to move data in parallel open a channel each. A Transport may be shared.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "farmem/common/config.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::transport {

// Where a lease lives: everything the data path needs to address it.
struct RemoteSlab {
  uint64_t lease_id = 0;
  uint64_t length = 0;
  uint64_t remote_addr = 0;  // verbs only
  uint32_t rkey = 0;         // verbs only

  static RemoteSlab From(const wire::LeaseGrant& g) {
    return {g.lease_id, g.length, g.remote_addr, g.rkey};
  }
};

// Local memory registered with a transport (verbs must register it with the NIC; tcp needs
// nothing). Unregistered memory works too, at the cost of a bounce copy on verbs.
class LocalRegion {
 public:
  virtual ~LocalRegion() = default;
  virtual void* addr() const = 0;
  virtual size_t length() const = 0;
  virtual uint32_t lkey() const = 0;
  bool Contains(const void* p, size_t n) const {
    auto b = static_cast<const uint8_t*>(addr());
    auto q = static_cast<const uint8_t*>(p);
    return q >= b && n <= length() && static_cast<size_t>(q - b) <= length() - n;
  }
};

enum class OpType : uint8_t { kRead, kWrite };

struct Op {
  OpType type = OpType::kRead;
  RemoteSlab slab;
  uint64_t offset = 0;  // within the slab
  // Destination of a read, source of a write. A read that fails leaves its destination's contents
  // unspecified (a transport may have received into it before it learned of the failure).
  void* local = nullptr;
  uint32_t length = 0;
  const LocalRegion* region = nullptr;  // registered memory that holds `local`, if any
  uint64_t user_data = 0;               // handed back in the Completion
};

struct Completion {
  uint64_t user_data = 0;
  Status status;
};

struct ChannelStats {
  uint64_t ops = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t doorbells = 0;  // Flush calls that sent something
};

class Channel {
 public:
  virtual ~Channel() = default;

  // Queues one operation. Fails at once (nothing queued) if the op is malformed, the channel is
  // broken, or max_outstanding() operations are already in flight.
  virtual Status Post(const Op& op) = 0;
  // Sends everything posted since the last Flush.
  virtual Status Flush() = 0;
  // Reaps up to out.size() completions. Waits up to `timeout` for the first one when any are
  // outstanding; returns 0 when none are. A channel that breaks completes every outstanding
  // operation with an error (Unavailable, RemoteAccessError, ...): nothing is left hanging.
  // A non-zero `timeout` is an operation timeout, not a slice to poll in: on tcp a reply that
  // does not come within it breaks the channel (its ops fail with DeadlineExceeded). To wait in
  // slices, poll(2) wait_fd() and call Poll with the operation timeout once it is readable
  // (ChannelSet), or use Execute.
  virtual Result<size_t> Poll(std::span<Completion> out, std::chrono::milliseconds timeout) = 0;

  virtual size_t outstanding() const = 0;
  virtual size_t max_outstanding() const = 0;
  virtual const char* kind() const = 0;  // "tcp" or "verbs"
  virtual std::string peer() const = 0;
  virtual bool broken() const = 0;
  virtual ChannelStats stats() const = 0;
  // A file descriptor that poll(2) reports readable when Poll() may have a completion to reap,
  // so one thread can wait on many channels at once (reads spread over k+r daemons). -1 when the
  // channel cannot be waited on that way: then the caller polls with a zero timeout.
  virtual int wait_fd() const { return -1; }
  // True when wait_fd() turning readable means exactly "Poll() has a completion": the channel
  // keeps nothing unreaped between Poll calls (tcp: each Poll receives one reply frame and hands
  // out all its completions). A waiter on many channels may then go straight to poll(2) on the fd
  // instead of probing Poll() first. False (verbs: a completion may land before the event fd is
  // armed): reap with a zero-timeout Poll() before waiting on the fd.
  virtual bool fd_readiness_is_exact() const { return false; }

  // Synchronous conveniences. Execute posts all ops (flushing as the window allows), waits for
  // all, stores each op's status in `results` (if given) and returns the first error.
  Status Execute(std::span<const Op> ops, std::span<Status> results = {},
                 std::chrono::milliseconds timeout = kDefaultTimeout);
  Status Read(const RemoteSlab& slab, uint64_t offset, std::span<uint8_t> dst,
              const LocalRegion* region = nullptr);
  Status Write(const RemoteSlab& slab, uint64_t offset, std::span<const uint8_t> src,
               const LocalRegion* region = nullptr);

  static constexpr std::chrono::milliseconds kDefaultTimeout{10000};
};

// Who we are, for the daemon's authentication.
struct Credentials {
  // The key of `identity`: the cluster secret for the built-in identity "cluster" (identity
  // empty), else the name's key (auth::ClientKey, farmemctl key issue). Empty: connect without
  // authenticating (the daemon must be open).
  std::string secret;
  std::string identity;        // the name to authenticate as; empty: "cluster"
  wire::ClientId client_id{};  // a label under the identity: leases are per (identity, id)
  std::string client_name;
};

struct ChannelOptions {
  Endpoint endpoint;  // the daemon's TCP address (verbs derives its rdma_cm address from it)
  Credentials credentials;
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds op_timeout{10000};
  uint32_t max_outstanding = 64;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* kind() const = 0;
  virtual Result<std::unique_ptr<Channel>> OpenChannel(const ChannelOptions& options) = 0;
  virtual Result<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, size_t length) = 0;
};

// The TCP transport (always available).
std::unique_ptr<Transport> MakeTcpTransport();

}  // namespace farmem::transport
