// LeaseAccessCounts: how often this client used each of its leases on one daemon, for the access
// report it sends that daemon on HEARTBEAT (docs/wire-protocol.md, HEARTBEAT; issue 12).
//
// Why: under memory pressure a daemon evicts the least active of a sample of leases, and it
// counts activity as the data operations it serves. One-sided RDMA reads and writes never reach
// its CPU, so a lease used only over verbs looks idle there and would be evicted before a cold
// one. The client counts those operations itself, per lease, and reports them.
//
// Who counts what: Cluster::OpenChannel wraps each data channel whose operations the daemon does
// not see (verbs; tcp too when ClusterOptions::report_tcp_accesses says so, for tests against a
// daemon run with --access-counts reported) in a counting channel (CountAccesses) that calls
// Count() for every operation posted, whatever thread owns the channel. The Cluster's background
// thread asks for the pending counts of the leases it holds there (Pending), sends them with the
// heartbeat, and Commits them once the daemon has answered: counts of a heartbeat that failed
// are sent with the next one.
//
// Layout: one slot per daemon slab (lease ids are epoch << 32 | slab index, and the daemon holds
// at most one lease per slab), tagged with the lease id that owns it; Track() claims the slot when
// a lease is granted. The table grows (by the control path, under mu_) to the highest slab index
// granted, up to kMaxSlots; beyond that slabs share slots by their low bits and the later grant
// takes the slot (its predecessor is then not counted: only on daemons with more than kMaxSlots
// slabs). A grown table replaces the old one; operations counted on the old one by a thread that
// loaded it just before are lost, which a heuristic of activity can afford. Old tables are kept
// until the counts are destroyed (the data path holds no reference a lock would protect), at most
// as much memory again as the current one.
//
// Threads: Count from any thread, lock-free (an acquire load and a relaxed fetch_add); the rest
// take mu_.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "farmem/common/mutex.h"
#include "farmem/common/wire.h"
#include "farmem/transport/transport.h"

namespace farmem::client::internal {

class LeaseAccessCounts {
 public:
  // The largest table (slots, 16 bytes each): 1 MiB per daemon.
  static constexpr uint32_t kMaxSlots = 1u << 16;

  LeaseAccessCounts() = default;
  LeaseAccessCounts(const LeaseAccessCounts&) = delete;
  LeaseAccessCounts& operator=(const LeaseAccessCounts&) = delete;

  // Data path: one operation on `lease_id`. Ignored for a lease that was never tracked.
  void Count(uint64_t lease_id) {
    const Table* t = table_.load(std::memory_order_acquire);
    if (t == nullptr) return;
    Slot& s = t->slots[wire::LeaseSlab(lease_id) & (t->size - 1)];
    if (s.lease_id.load(std::memory_order_relaxed) == lease_id) {
      s.count.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // `lease_id` was granted to this client: it is counted from 0 from now on.
  void Track(uint64_t lease_id) EXCLUDES(mu_);

  // Per lease of `held` (the leases this client holds there): the operations since the last
  // committed report, leases without any left out; the busiest first and at most `max` of them
  // when there are more. Empty: nothing to report (send an empty HEARTBEAT).
  wire::HeartbeatRequest Pending(std::span<const uint64_t> held,
                                 size_t max = wire::kMaxLeasesPerCall) EXCLUDES(mu_);
  // The daemon took `report` (a Pending result): those operations are not reported again.
  void Commit(const wire::HeartbeatRequest& report) EXCLUDES(mu_);

  // Operations reported and committed since construction.
  uint64_t reported() const { return reported_total_.load(std::memory_order_relaxed); }

 private:
  struct Slot {
    std::atomic<uint64_t> lease_id{0};  // 0: no lease
    std::atomic<uint64_t> count{0};     // operations since Track
    uint64_t reported = 0;              // of `count`, committed to the daemon (under mu_)
  };
  struct Table {
    explicit Table(uint32_t n) : size(n), slots(new Slot[n]) {}
    const uint32_t size;  // a power of two
    const std::unique_ptr<Slot[]> slots;
  };
  // The slot of `lease_id` if the lease owns it, else nullptr.
  Slot* Find(uint64_t lease_id) REQUIRES(mu_);

  std::atomic<const Table*> table_{nullptr};  // tables_.back(), for the data path
  Mutex mu_;
  std::vector<std::unique_ptr<Table>> tables_ GUARDED_BY(mu_);
  std::atomic<uint64_t> reported_total_{0};
};

// `channel`, with every operation posted on it counted in `counts` (Execute, Read and Write
// included: they post). Everything else is the inner channel's.
std::unique_ptr<transport::Channel> CountAccesses(std::unique_ptr<transport::Channel> channel,
                                                  std::shared_ptr<LeaseAccessCounts> counts);

}  // namespace farmem::client::internal
