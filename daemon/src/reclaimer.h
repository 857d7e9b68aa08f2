// Reclaimer: farmemd gives memory back to its host — under local memory pressure and when it is
// drained (issue 12; docs/operations.md "Memory pressure and drain").
//
// Every --pressure-interval-ms it reads the MemorySource, lets the PressurePolicy set the pool's
// grant budget, and when the policy wants memory back picks victims (a random sample of E + extra
// leases, the E least active: pressure.h) and puts them under notice: each owner is sent one
// EVICT_NOTICE (through the NoticeSink, the Server) naming its leases and the grace period; a
// lease its owner has not freed by the deadline is ended (rkey deregistered, memory returned).
// Drain() does the same for every lease at once and stops all granting; Undrain() lifts it.
//
// Threads: Start/Stop from the owner (the Server); Drain/Undrain/Poll from any thread (Poll is
// what the thread runs, exposed for tests). The policy is only touched under mu_.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>

#include "farmem/common/mutex.h"
#include "memory_source.h"
#include "pressure.h"
#include "slab_pool.h"

namespace farmem::daemon {

// Where notices go: the connections of the lease's owner (Server implements it).
class NoticeSink {
 public:
  virtual ~NoticeSink() = default;
  virtual void DeliverNotice(const EvictionNotice& notice) = 0;
};

struct ReclaimOptions {
  // Null: the host is not watched (only drains take memory back).
  std::shared_ptr<MemorySource> source;
  PressureConfig pressure;
  std::chrono::milliseconds interval{250};
  // How long an owner has to move its data after an EVICT_NOTICE sent for memory pressure.
  std::chrono::milliseconds evict_grace{5000};
  uint32_t sample_extra = 2;  // leases sampled beyond those to evict (Infiniswap's E + extra)
};

class Reclaimer {
 public:
  Reclaimer(ReclaimOptions options, SlabPool* pool, NoticeSink* sink);
  ~Reclaimer();

  void Start();
  void Stop() EXCLUDES(mu_);

  // One round: evictions that are due, then a pressure decision. Returns leases noticed.
  uint32_t Poll() EXCLUDES(mu_);
  // Stops granting and notices every lease (grace: how long owners have). Returns how many.
  uint32_t Drain(std::chrono::milliseconds grace) EXCLUDES(mu_);
  void Undrain() EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);
  uint32_t Notice(std::optional<std::span<const uint64_t>> ids, std::chrono::milliseconds grace);

  const ReclaimOptions options_;
  SlabPool* const pool_;
  NoticeSink* const sink_;
  Mutex mu_;
  CondVar cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  PressurePolicy policy_ GUARDED_BY(mu_);
  std::mt19937_64 rng_ GUARDED_BY(mu_);
  bool source_failing_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace farmem::daemon
