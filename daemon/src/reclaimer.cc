#include "reclaimer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "farmem/common/config.h"

namespace farmem::daemon {

Reclaimer::Reclaimer(ReclaimOptions options, SlabPool* pool, NoticeSink* sink)
    : options_(std::move(options)),
      pool_(pool),
      sink_(sink),
      policy_(options_.pressure),
      rng_(std::random_device{}()) {}

Reclaimer::~Reclaimer() { Stop(); }

void Reclaimer::Start() {
  if (options_.source != nullptr) {
    spdlog::info(
        "watching memory of {}: lends only while more than --reserve {} stays free{}; evicted "
        "leases get {} ms of notice",
        options_.source->name(), options_.pressure.reserve.text,
        options_.pressure.psi_full_threshold > 0
            ? fmt::format(", and not while memory stalls (PSI full) reach {}%",
                          options_.pressure.psi_full_threshold)
            : "",
        options_.evict_grace.count());
  }
  thread_ = std::thread([this] { Loop(); });
}

void Reclaimer::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void Reclaimer::Loop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    lock.Unlock();
    Poll();
    lock.Lock();
    cv_.WaitFor(&mu_, options_.interval, [&] {
      mu_.AssertHeld();
      return stopping_;
    });
  }
}

uint32_t Reclaimer::Poll() {
  pool_->EvictDue();
  if (options_.source == nullptr) return 0;
  Result<MemorySnapshot> snap = options_.source->Read();
  PressureDecision d;
  uint64_t seed = 0;
  {
    MutexLock lock(&mu_);
    if (!snap.has_value()) {
      if (!source_failing_) {
        spdlog::warn("reading {} failed: {}; lending as before until it works again",
                     options_.source->name(), snap.error().ToString());
        source_failing_ = true;
      }
      return 0;
    }
    source_failing_ = false;
    const PoolStats st = pool_->stats();
    d = policy_.Update(*snap, st.slab_size, st.noticed_slabs);
    seed = rng_();
  }
  pool_->SetGrantBudget(d.grant_budget);
  if (d.changed) {
    if (d.holding) {
      spdlog::warn("memory pressure: {}; granting no slabs", d.why);
    } else {
      spdlog::info("memory pressure over: {}; granting again", d.why);
    }
  }
  if (d.evict == 0) return 0;
  const std::vector<LeaseActivity> sample =
      pool_->SampleLeases(d.evict + options_.sample_extra, seed);
  const std::vector<uint64_t> victims = ChooseVictims(sample, d.evict);
  if (victims.empty()) return 0;
  spdlog::warn("memory pressure: {}; evicting {} lease(s), the least active of {} sampled", d.why,
               victims.size(), sample.size());
  return Notice(std::span<const uint64_t>(victims), options_.evict_grace);
}

uint32_t Reclaimer::Drain(std::chrono::milliseconds grace) {
  pool_->SetDraining(true);
  const uint32_t n = Notice(std::nullopt, grace);
  spdlog::warn("draining: granting nothing; {} lease(s) noticed to move within {} ms", n,
               grace.count());
  return n;
}

void Reclaimer::Undrain() {
  pool_->SetDraining(false);
  pool_->CancelNotices();
  spdlog::info("undrained: granting again; pending eviction notices are lifted");
}

uint32_t Reclaimer::Notice(std::optional<std::span<const uint64_t>> ids,
                           std::chrono::milliseconds grace) {
  const std::vector<EvictionNotice> notices =
      pool_->NoticeEviction(ids, std::chrono::steady_clock::now() + grace);
  uint32_t n = 0;
  for (const EvictionNotice& notice : notices) {
    n += static_cast<uint32_t>(notice.lease_ids.size());
    if (sink_ != nullptr) sink_->DeliverNotice(notice);
  }
  return n;
}

}  // namespace farmem::daemon
