// SlabPool: the memory a farmemd lends, cut into equal slabs, and the leases on them.
//
// Memory on demand: the pool reserves `capacity` bytes of address space at start (no memory:
// MAP_NORESERVE, nothing touched), so start-up is immediate and --capacity is a ceiling. A slab's
// pages are populated (and mlocked where permitted) when it is leased, and returned to the kernel
// with MADV_DONTNEED when the lease ends, which also makes the next lease of it read zeros: no
// client ever sees another's data (docs/benchmarks.md compares this with munmap and MADV_FREE).
// The address range stays mapped throughout, so an RDMA registration or a racing data operation
// never meets a hole. Each slab is free or held by exactly one lease; a lease is owned by one
// client id. Lease ids are (epoch << 32 | slab): the epoch changes on every grant, so an id from an
// ended lease never matches again.
//
// Huge pages (PoolOptions::huge_pages, on by default): a slab is populated with 4 KiB pages when
// it is leased (fast: no compaction on the lease path), and then, in the background, collapsed
// into 2 MiB transparent huge pages (MADV_COLLAPSE, Linux 6.1+; the pool is 2 MiB-aligned), so
// that the data path's copies in and out of lent memory do not take a TLB miss every 4 KiB
// (2026-12-05: the six daemons' CPU per write of farmem-nbd's mixed-size job 9-20% lower,
// docs/benchmarks-nbd.md). Best effort: a slab the kernel cannot collapse (no free huge page,
// too old a kernel) stays as it is, counted; none is collapsed while the host is short of memory
// or the daemon drains (a collapse may reclaim and compact); slabs registered for RDMA are not
// collapsed (a registration pins their pages, which a collapse would have to move). Zeroing at
// the end of a lease (MADV_DONTNEED) frees huge pages like small ones.
//
// Taking memory back (pressure.h decides when): the pool can be told to grant no more than a
// budget of slabs, or nothing while it drains; it samples leases with their access counts (TCP
// operations counted in Acquire; one-sided RDMA is invisible to the daemon and counts 0), marks
// chosen leases with an eviction deadline (NoticeEviction) and ends them once it passes
// (EvictDue) unless their owner freed them first.
//
// Threading: control operations (Grant/Release/Renew/ReclaimExpired) take mu_ and may be called
// from any thread. Grant populates (mlocks) and registers its slabs between two short holds of
// mu_, not under it: that can take seconds, and a heartbeat must not wait for it. The data path
// (Pin) is lock-free: it raises the slab's user count and then checks the lease id; ending a lease
// clears the id and waits for the count to drop before the memory is zeroed and handed out again,
// so no read or write ever lands in someone else's lease.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
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
  bool mlock = true;     // mlock each slab when leased; warn once and continue when not permitted
  bool prefault = true;  // populate a slab's pages when it is leased, not at first access
  // Victim choice counts the data operations the daemon serves (TCP) as activity, besides what
  // clients report (CreditAccesses). False (--access-counts reported): only the reports, so a
  // test can exercise the client's reports over TCP.
  bool count_served_accesses = true;
  // Populate (and mlock) every slab before serving and keep it populated after its lease ends,
  // zeroed by memset: the pool as it was before memory on demand (--populate-at-start), so that
  // benchmarks compare the two in one build. Start-up then takes as long as faulting in the
  // capacity, and the daemon's RSS is the capacity from the start.
  bool populate_at_start = false;
  // Collapse leased slabs into transparent huge pages in the background (see the header
  // comment); --no-huge-pages turns it off. Only for slabs that are a multiple of 2 MiB.
  bool huge_pages = true;
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
// it), thread-safe. The pool calls it at grant without its lock (two grants may register
// different slabs at once), before the lease id is published; and with its lock held when a
// lease ends (freed, expired, evicted), before the memory is zeroed — after DeregisterLease
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
  uint32_t free_slabs = 0;  // slabs that may be granted now (pressure and draining count)
  uint32_t leased_slabs = 0;
  uint32_t noticed_slabs = 0;  // leased and under an eviction notice
  bool draining = false;
  bool holding = false;  // memory pressure: granting less than what is free, or nothing
  // Since start: leases ended because their client stopped heartbeating, or at the deadline of
  // an eviction notice (the client did not free them in time).
  uint64_t expired_leases = 0;
  uint64_t evicted_leases = 0;
  uint64_t granted_leases = 0;
  // Leased slabs collapsed into huge pages, and those the kernel refused (PoolOptions::huge_pages).
  uint64_t huge_page_slabs = 0;
  uint64_t huge_page_failures = 0;
  // Leased slabs left with 4 KiB pages because, when their turn came, the host was short of
  // memory (the pool held memory back) or the daemon drained.
  uint64_t huge_page_skips = 0;
};

// A leased slab as victim selection sees it (SlabPool::SampleLeases).
struct LeaseActivity {
  uint32_t slab = 0;
  uint64_t lease_id = 0;
  uint64_t accesses = 0;  // data operations since the previous sample of this lease
};

// The leases of one owner that are to be evicted, for one EVICT_NOTICE.
struct EvictionNotice {
  wire::ClientId owner{};
  std::vector<uint64_t> lease_ids;
  uint32_t grace_ms = 0;
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
  // Extends every lease of `owner`; returns how many it holds. With `noticed`: also those of
  // them under an eviction notice, with the grace left (HEARTBEAT reports them, so that a notice
  // outlives the connection it was pushed on), at most kMaxLeasesPerCall, soonest first.
  uint32_t Renew(const wire::ClientId& owner, std::vector<wire::NoticedLease>* noticed = nullptr);
  // Ends leases whose owner has not renewed within the TTL; returns how many.
  uint32_t ReclaimExpired();

  // Data path: checks lease, owner and bounds; the Pin keeps the memory valid until destroyed.
  Result<Pin> Acquire(uint64_t lease_id, const wire::ClientId& owner, uint64_t offset,
                      uint64_t length);

  PoolStats stats() const;
  // Slabs leased per client (metrics: farmem_daemon_client_leased_bytes).
  std::map<wire::ClientId, uint32_t> LeasesByOwner() const;

  // ---- taking memory back (driven by the Reclaimer, reclaimer.h) ----
  // At most `slabs` more grants until the next call; nullopt: no limit but the free slabs.
  void SetGrantBudget(std::optional<uint32_t> slabs);
  // While draining, ALLOC is refused with Unavailable.
  void SetDraining(bool draining);
  bool draining() const;
  // Up to `n` distinct leased slabs not yet under notice, chosen at random, each with its access
  // count since it was last sampled (the count restarts from here).
  std::vector<LeaseActivity> SampleLeases(uint32_t n, uint64_t seed);
  // Adds a client's own count of accesses the daemon did not see (one-sided RDMA, reported on
  // HEARTBEAT) to its leases, so that SampleLeases weighs them like TCP operations. Reports for
  // leases `owner` does not hold (ended meanwhile, or someone else's) are ignored. Returns how
  // many reports were credited.
  uint32_t CreditAccesses(const wire::ClientId& owner, std::span<const wire::AccessReport> reports);
  // Marks the named leases (those still held and not yet noticed) to end at `deadline`, and
  // returns one notice per owner. nullopt ids: every held lease (drain).
  std::vector<EvictionNotice> NoticeEviction(std::optional<std::span<const uint64_t>> lease_ids,
                                             std::chrono::steady_clock::time_point deadline);
  // Ends noticed leases whose deadline has passed; returns how many.
  uint32_t EvictDue();
  // Lifts every pending notice (undrain): the leases stay.
  void CancelNotices();
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
    std::atomic<uint64_t> accesses{0};  // data operations on the current lease (Acquire)
    uint64_t accesses_seen = 0;         // accesses at the last sample
    std::chrono::steady_clock::time_point evict_at{};  // {}: no notice
    bool populated = false;  // pages mapped in (and maybe locked) for a lease
    bool locked = false;
    // Taken off the free list by a Grant that populates it outside mu_ (owner is set): neither
    // free nor leased yet, counted in the owner's share.
    bool granting = false;
  };

  explicit SlabPool(const PoolOptions& options) : options_(options) {}
  // The huge-page thread: collapses the slabs of grants queued in collapse_queue_ while they are
  // still leased (the same lease), one at a time, without mu_.
  void CollapseLoop() EXCLUDES(mu_);
  // One slab: MADV_HUGEPAGE, MADV_COLLAPSE, MADV_NOHUGEPAGE again (a slab populated at its next
  // lease takes 4 KiB pages, without compaction). The errno of a failed collapse, 0 if done.
  int Collapse(uint32_t index);
  // Clears the lease at once (no new data operation can start on it, its RDMA region is gone);
  // the slab is zeroed and freed by ReclaimDrained once no data operation still uses it, so
  // ending a lease never waits, under mu_, for a peer that is slow to send or receive.
  void EndLease(uint32_t index) REQUIRES(mu_);
  void ReclaimDrained() REQUIRES(mu_);
  // Maps a slab's pages in (and locks them) for a grant; gives them back to the kernel, zeroed
  // for the next lease, when the lease has ended. Populate runs without mu_ (on a slab a Grant
  // took off the free list, which no other thread touches; or at start) and returns the errno
  // of a failed mlock (0: locked, or not asked to).
  int Populate(uint32_t index);
  // Logs Populate's mlock failure (errno, 0: none) once per pool, with how to fix it.
  void WarnMlockFailed(int mlock_errno) REQUIRES(mu_);
  void ReturnMemory(uint32_t index) REQUIRES(mu_);
  uint32_t Grantable() const REQUIRES(mu_);
  // Memory pressure: the pool grants less than is free (a grant budget under the free slabs).
  bool HoldingLocked() const REQUIRES(mu_) {
    return grant_budget_.has_value() && *grant_budget_ < free_list_.size();
  }
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
  std::optional<uint32_t> grant_budget_ GUARDED_BY(mu_);
  bool draining_mode_ GUARDED_BY(mu_) = false;
  uint64_t expired_total_ GUARDED_BY(mu_) = 0;
  uint64_t evicted_total_ GUARDED_BY(mu_) = 0;
  uint64_t granted_total_ GUARDED_BY(mu_) = 0;
  bool warned_mlock_ GUARDED_BY(mu_) = false;
  // Huge pages: (slab, lease id) of grants to collapse, the thread's wake-up and stop.
  std::vector<std::pair<uint32_t, uint64_t>> collapse_queue_ GUARDED_BY(mu_);
  CondVar collapse_cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  bool collapse_unsupported_ GUARDED_BY(mu_) = false;  // EINVAL once: not tried again
  uint64_t huge_page_slabs_ GUARDED_BY(mu_) = 0;
  uint64_t huge_page_failures_ GUARDED_BY(mu_) = 0;
  uint64_t huge_page_skips_ GUARDED_BY(mu_) = 0;
  std::thread collapser_;
};

}  // namespace farmem::daemon
