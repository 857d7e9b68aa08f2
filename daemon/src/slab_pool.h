// SlabPool: the memory a farmemd lends, cut into equal slabs, and the leases on them.
//
// The pool maps `capacity` bytes once at start (mlocked when permitted, transparent huge pages
// when available) and never returns them to the OS while running. Each slab is free or held by
// exactly one lease; a lease is owned by one client id. Lease ids are (epoch << 32 | slab): the
// epoch changes on every grant, so an id from an ended lease never matches again.
//
// Threading: control operations (Grant/Release/Renew/ReclaimExpired) take mu_ and may be called
// from any thread. The data path (Pin) is lock-free: it raises the slab's user count and then
// checks the lease id; ending a lease clears the id and waits for the count to drop before the
// memory is zeroed and handed out again, so no read or write ever lands in someone else's lease.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/status.h"
#include "farmem/common/wire.h"

namespace farmem::daemon {

// How much of a daemon one client may hold (--max-client-share): a fraction of the pool ("0.5",
// "50%"; "1" is all of it) or a size ("512M"). `text` is what the operator wrote, for messages.
struct ClientShare {
  double fraction = 0.75;
  uint64_t bytes = 0;  // used when non-zero
  std::string text = "0.75";
};
// A number in (0, 1] or a percentage is a fraction; anything else is a size (ParseSize).
Result<ClientShare> ParseClientShare(std::string_view text);

struct PoolOptions {
  uint64_t capacity = 1ull << 30;
  uint64_t slab_size = 64ull << 20;
  std::chrono::milliseconds lease_ttl{10000};
  bool mlock = true;     // try to mlock; warn and continue when not permitted
  bool prefault = true;  // touch every page at start so lending never waits on the kernel
  // The default leaves a quarter of every daemon to other clients, while a lone client still
  // reaches three quarters of the cluster.
  ClientShare max_client_share{};
};

// Keeps a slab's memory valid for the duration of one data operation.
class Pin {
 public:
  Pin() = default;
  Pin(std::atomic<uint32_t>* users, uint8_t* data) : users_(users), data_(data) {}
  Pin(Pin&& o) noexcept : users_(o.users_), data_(o.data_) { o.users_ = nullptr; }
  Pin& operator=(Pin&& o) noexcept {
    if (this != &o) {
      Reset();
      users_ = o.users_;
      data_ = o.data_;
      o.users_ = nullptr;
    }
    return *this;
  }
  ~Pin() { Reset(); }
  uint8_t* data() const { return data_; }
  void Reset() {
    if (users_ != nullptr) users_->fetch_sub(1, std::memory_order_release);
    users_ = nullptr;
  }

 private:
  std::atomic<uint32_t>* users_ = nullptr;
  uint8_t* data_ = nullptr;
};

// Makes lent memory reachable by RDMA, one memory region per lease (rdma_listener.h implements
// it). The pool calls it with its lock held: at grant, before the lease id is published, and when
// a lease ends (freed, expired, evicted), before the memory is zeroed — after DeregisterLease
// returns, the lease's rkey is dead and no RDMA access can reach the slab.
class LeaseRegistrar {
 public:
  virtual ~LeaseRegistrar() = default;
  // Returns the rkey of a region over [addr, addr + length) that only `owner` can use.
  virtual Result<uint32_t> RegisterLease(uint32_t slab, const wire::ClientId& owner, void* addr,
                                         uint64_t length) = 0;
  virtual void DeregisterLease(uint32_t slab) = 0;
};

struct PoolStats {
  uint64_t capacity = 0;
  uint64_t slab_size = 0;
  uint32_t total_slabs = 0;
  uint32_t free_slabs = 0;
};

class SlabPool {
 public:
  static Result<std::unique_ptr<SlabPool>> Create(const PoolOptions& options);
  ~SlabPool();

  // All-or-nothing: `count` slabs for `owner`, or ResourceExhausted (the pool is short, or `owner`
  // would hold more than max_client_share; the message says which).
  Result<std::vector<wire::LeaseGrant>> Grant(uint32_t count, const wire::ClientId& owner);
  // Ends leases held by `owner`. Every id is checked before any is released.
  Status Release(std::span<const uint64_t> lease_ids, const wire::ClientId& owner);
  // Extends every lease of `owner`; returns how many it holds.
  uint32_t Renew(const wire::ClientId& owner);
  // Ends leases whose owner has not renewed within the TTL; returns how many.
  uint32_t ReclaimExpired();

  // Data path: checks lease, owner and bounds; the Pin keeps the memory valid until destroyed.
  Result<Pin> Acquire(uint64_t lease_id, const wire::ClientId& owner, uint64_t offset,
                      uint64_t length);

  PoolStats stats() const;
  // What `owner` may still lease here: the free slabs, capped by what max_client_share leaves it.
  struct ClientRoom {
    uint32_t may_take = 0;
    uint32_t limit = 0;  // max_client_share in slabs
  };
  ClientRoom RoomFor(const wire::ClientId& owner) const;
  // Every lease granted from now on is registered with `registrar` (nullptr: none). Set before
  // serving; detach (nullptr) only when no lease is registered any more or the registrar has
  // dropped its regions itself (RdmaListener::Stop does).
  void SetRegistrar(LeaseRegistrar* registrar);
  uint8_t* base() const { return base_; }
  uint64_t slab_size() const { return options_.slab_size; }
  std::chrono::milliseconds lease_ttl() const { return options_.lease_ttl; }

 private:
  struct Slab {
    std::atomic<uint64_t> lease_id{0};  // 0: free
    std::atomic<uint32_t> users{0};
    wire::ClientId owner{};
    std::chrono::steady_clock::time_point expiry{};
  };

  explicit SlabPool(const PoolOptions& options) : options_(options) {}
  // Clears the lease at once (no new data operation can start on it, its RDMA region is gone);
  // the slab is zeroed and freed by ReclaimDrained once no data operation still uses it, so
  // ending a lease never waits, under mu_, for a peer that is slow to send or receive.
  void EndLease(uint32_t index) REQUIRES(mu_);
  void ReclaimDrained() REQUIRES(mu_);
  // Slabs `owner` holds a lease on.
  uint32_t HeldBy(const wire::ClientId& owner) const REQUIRES(mu_);

  PoolOptions options_;
  uint8_t* base_ = nullptr;
  uint64_t mapped_ = 0;
  std::unique_ptr<Slab[]> slabs_;
  uint32_t total_ = 0;
  uint32_t max_client_slabs_ = 0;  // per client, from options_.max_client_share
  mutable Mutex mu_;
  std::vector<uint32_t> free_list_ GUARDED_BY(mu_);
  std::vector<uint32_t> draining_ GUARDED_BY(mu_);  // ended, still pinned by a data operation
  uint32_t next_epoch_ GUARDED_BY(mu_) = 1;
  LeaseRegistrar* registrar_ GUARDED_BY(mu_) = nullptr;
};

}  // namespace farmem::daemon
