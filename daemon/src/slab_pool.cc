#include "slab_pool.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "farmem/common/config.h"

namespace farmem::daemon {

namespace {
constexpr uint64_t kHugePage = 2ull << 20;  // x86-64's transparent huge page
}  // namespace

Result<ClientShare> ParseClientShare(std::string_view text) {
  ClientShare share;
  share.text = std::string(text);
  std::string_view s = text;
  const bool percent = s.ends_with('%');
  if (percent) s.remove_suffix(1);
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  const bool plain_number = ec == std::errc() && ptr == s.data() + s.size() && !s.empty();
  if (percent || (plain_number && v <= 1.0)) {
    const double f = percent ? v / 100 : v;
    if (!plain_number || !(f > 0 && f <= 1)) {
      return Err(InvalidArgument(fmt::format(
          "--max-client-share '{}': a fraction must be in (0, 1] (e.g. 0.5 or 50%), or give a "
          "size such as 512M",
          text)));
    }
    share.fraction = f;
    return share;
  }
  Result<uint64_t> bytes = ParseSize(text);
  if (!bytes.has_value() || *bytes == 0) {
    return Err(InvalidArgument(
        fmt::format("--max-client-share '{}' is neither a fraction in (0, 1] (e.g. 0.5, 50%) nor "
                    "a size (e.g. 512M)",
                    text)));
  }
  share.bytes = *bytes;
  return share;
}

Result<std::unique_ptr<SlabPool>> SlabPool::Create(const PoolOptions& options) {
  if (options.slab_size < 4096 || options.slab_size % 4096 != 0) {
    return Err(InvalidArgument(
        fmt::format("slab size {} must be a multiple of 4 KiB", options.slab_size)));
  }
  if (options.slab_size > (4ull << 30)) {
    return Err(InvalidArgument("slab size must be at most 4 GiB"));
  }
  const uint64_t slabs = options.capacity / options.slab_size;
  if (slabs == 0) {
    return Err(
        InvalidArgument(fmt::format("capacity {} is smaller than one slab ({})",
                                    FormatSize(options.capacity), FormatSize(options.slab_size))));
  }
  if (slabs > 1'000'000) return Err(InvalidArgument("more than a million slabs: use larger slabs"));
  const ClientShare& share = options.max_client_share;
  uint64_t share_slabs = share.bytes != 0 ? share.bytes / options.slab_size
                                          : static_cast<uint64_t>(share.fraction * slabs);
  if (share.bytes != 0 && share_slabs == 0) {
    return Err(InvalidArgument(fmt::format(
        "--max-client-share {} is smaller than one slab ({}): no client could lease anything",
        share.text, FormatSize(options.slab_size))));
  }
  share_slabs = std::clamp<uint64_t>(share_slabs, 1, slabs);
  std::unique_ptr<SlabPool> pool(new SlabPool(options));
  pool->total_ = static_cast<uint32_t>(slabs);
  pool->max_client_slabs_ = static_cast<uint32_t>(share_slabs);
  pool->mapped_ = slabs * options.slab_size;
  // Address space only: no page is touched (or charged) before a slab is leased.
  // 2 MiB-aligned, so that every 2 MiB of a slab can become one huge page (PoolOptions::
  // huge_pages): a little more is reserved and the ends are given back.
  const bool huge =
      options.huge_pages && !options.populate_at_start && options.slab_size % kHugePage == 0;
  const uint64_t reserve = pool->mapped_ + (huge ? kHugePage : 0);
  void* p = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p != MAP_FAILED && huge) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (at + kHugePage - 1) & ~uintptr_t{kHugePage - 1};
    if (aligned > at) ::munmap(p, aligned - at);
    if (const uintptr_t end = at + reserve, used = aligned + pool->mapped_; end > used) {
      ::munmap(reinterpret_cast<void*>(used), end - used);
    }
    p = reinterpret_cast<void*>(aligned);
  }
  if (p == MAP_FAILED) {
    return Err(ErrnoStatus(
        StatusCode::kResourceExhausted,
        fmt::format("reserving {} of address space for the slab pool", FormatSize(pool->mapped_)),
        errno));
  }
  pool->base_ = static_cast<uint8_t*>(p);
  // Transparent huge pages only for a pool populated once, at start. Slabs populated when they
  // are leased use 4 KiB pages (MADV_NOHUGEPAGE, also where THP is "always"): with huge pages a
  // fault of a slab may compact memory first (THP defrag "madvise", Debian's default), and
  // locking a 64 MiB slab took 0.14-3.6 s instead of 50-160 ms with 4 KiB pages (same host, load
  // 16, 2026-12-03) — a borrower's write waits for its group's slabs, so a stripe-layout export
  // wrote 14-44 pages a second for seconds after it filled its first groups. (Either flag also
  // tells the pool apart in /proc/PID/smaps: tests/support/memory_scan.h.)
  const int advice = options.populate_at_start ? MADV_HUGEPAGE : MADV_NOHUGEPAGE;
  if (::madvise(p, pool->mapped_, advice) != 0) {
    spdlog::info("madvise({}) on the slab pool: {}",
                 options.populate_at_start ? "MADV_HUGEPAGE" : "MADV_NOHUGEPAGE", strerror(errno));
  }
  pool->slabs_ = std::make_unique<Slab[]>(slabs);
  {
    MutexLock lock(&pool->mu_);  // not shared yet: uncontended, taken for the analysis
    pool->free_list_.reserve(slabs);
    for (uint32_t i = pool->total_; i > 0; --i) pool->free_list_.push_back(i - 1);
    std::random_device rd;
    pool->next_epoch_ = std::uniform_int_distribution<uint32_t>(1, UINT32_MAX / 2)(rd);
    if (options.populate_at_start) {
      int mlock_errno = 0;
      for (uint32_t i = 0; i < pool->total_; ++i) {
        if (const int e = pool->Populate(i); e != 0) mlock_errno = e;
      }
      pool->WarnMlockFailed(mlock_errno);
    }
  }
  if (huge) pool->collapser_ = std::thread([q = pool.get()] { q->CollapseLoop(); });
  spdlog::info(
      "slab pool: up to {} in {} slabs of {}, mapped{} {}; each client may hold {} slab(s) ({}, "
      "--max-client-share {})",
      FormatSize(pool->mapped_), slabs, FormatSize(options.slab_size),
      options.mlock ? " and mlocked" : "",
      options.populate_at_start ? "at start and kept (--populate-at-start)"
                                : "when leased and returned when freed",
      share_slabs, FormatSize(share_slabs * options.slab_size), share.text);
  return pool;
}

SlabPool::~SlabPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  collapse_cv_.SignalAll();
  if (collapser_.joinable()) collapser_.join();
  if (base_ != nullptr) ::munmap(base_, mapped_);
}

void SlabPool::CollapseLoop() {
  for (;;) {
    uint32_t index = 0;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && (collapse_queue_.empty() || collapse_unsupported_)) {
        collapse_cv_.Wait(&mu_);
      }
      if (stopping_) return;
      const auto [slab, id] = collapse_queue_.front();
      collapse_queue_.erase(collapse_queue_.begin());
      // Only the lease it was queued for: one that ended meanwhile was zeroed (and may be
      // another client's by now, collapsed by its own grant).
      if (slabs_[slab].lease_id.load(std::memory_order_relaxed) != id) continue;
      // Not while the host is short of memory (the pool grants less than is free, pressure.h) or
      // the daemon drains: a collapse may reclaim and compact the host's memory, and such leases
      // are about to be evicted.
      if (draining_mode_ || HoldingLocked()) {
        ++huge_page_skips_;
        continue;
      }
      index = slab;
      // Held like a data operation: if the lease ends meanwhile, its memory is zeroed and given
      // back once the collapse is done (ReclaimDrained below), not under it — a collapse of
      // memory just given back would fill it again.
      slabs_[index].users.fetch_add(1, std::memory_order_seq_cst);
    }
    const int err = Collapse(index);
    MutexLock lock(&mu_);
    slabs_[index].users.fetch_sub(1, std::memory_order_seq_cst);
    ReclaimDrained();
    if (err == 0) {
      ++huge_page_slabs_;
      continue;
    }
    ++huge_page_failures_;
    if (err == EINVAL) {  // not here, or not for this process: stop trying
      collapse_unsupported_ = true;
      spdlog::info(
          "slab pool: the kernel refused to collapse a leased slab into huge pages (EINVAL: no "
          "MADV_COLLAPSE before Linux 6.1, transparent huge pages disabled for this process, or "
          "the slab's pages were not populated); leased slabs keep 4 KiB pages");
    } else if (huge_page_failures_ == 1) {
      spdlog::info(
          "slab pool: a leased slab could not be collapsed into huge pages ({}); it keeps "
          "4 KiB pages (farmem_daemon_huge_page_failures_total counts them)",
          strerror(err));
    }
  }
}

int SlabPool::Collapse(uint32_t index) {
#ifndef MADV_COLLAPSE
  constexpr int MADV_COLLAPSE = 25;  // Linux 6.1; older headers lack it
#endif
  uint8_t* addr = base_ + uint64_t{index} * options_.slab_size;
  if (::madvise(addr, options_.slab_size, MADV_HUGEPAGE) != 0) return errno;
  const int err = ::madvise(addr, options_.slab_size, MADV_COLLAPSE) == 0 ? 0 : errno;
  (void)::madvise(addr, options_.slab_size, MADV_NOHUGEPAGE);
  return err;
}

Result<std::vector<wire::LeaseGrant>> SlabPool::Grant(uint32_t count, const wire::ClientId& owner) {
  MutexLock lock(&mu_);
  ReclaimDrained();
  // (A share of the whole pool is no limit: then "not enough free" is the whole story.)
  if (max_client_slabs_ < total_ &&
      (count > max_client_slabs_ || HeldBy(owner) > max_client_slabs_ - count)) {
    const uint32_t held = HeldBy(owner);
    return Err(ResourceExhausted(fmt::format(
        "asked for {} slab(s) but this client already holds {} and may hold at most {} ({}) of "
        "this daemon's {} (--max-client-share {}): free some, use other daemons, or raise "
        "--max-client-share on this daemon",
        count, held, max_client_slabs_,
        FormatSize(uint64_t{max_client_slabs_} * options_.slab_size), total_,
        options_.max_client_share.text)));
  }
  if (draining_mode_) {
    return Err(Unavailable(
        "this daemon is draining (farmemctl drain, or shutting down): it grants no slabs; use "
        "other daemons"));
  }
  if (count > Grantable()) {
    if (count <= free_list_.size()) {
      return Err(ResourceExhausted(fmt::format(
          "asked for {} slabs but this daemon grants only {} now: its host is short of memory "
          "(--reserve), {} of {} slabs are free",
          count, Grantable(), free_list_.size(), total_)));
    }
    return Err(ResourceExhausted(fmt::format("asked for {} slabs but only {} of {} are free", count,
                                             free_list_.size(), total_)));
  }
  // Taken off the free list now and populated (mlocked) and registered below, without mu_:
  // locking a slab's pages can take seconds while the kernel compacts memory (3.6 s measured for
  // 64 MiB with transparent huge pages at load 16), and every client's heartbeat (Renew), STAT
  // and FREE takes mu_ — holding it here made healthy daemons look dead to other clients
  // (failure timeout 2 s). `granting` keeps the slabs counted against this client's share.
  std::vector<uint32_t> picked(count);
  for (uint32_t& index : picked) {
    index = free_list_.back();
    free_list_.pop_back();
    slabs_[index].owner = owner;
    slabs_[index].granting = true;
  }
  if (grant_budget_.has_value()) *grant_budget_ -= count;
  LeaseRegistrar* const registrar = registrar_;
  lock.Unlock();

  std::vector<uint32_t> rkeys(count, 0);
  int mlock_errno = 0;
  Status failed;
  size_t populated = 0;
  for (; populated < count && failed.ok(); ++populated) {
    const uint32_t index = picked[populated];
    if (const int e = Populate(index); e != 0) mlock_errno = e;
    if (registrar != nullptr) {
      Result<uint32_t> r = registrar->RegisterLease(
          index, owner, base_ + uint64_t{index} * options_.slab_size, options_.slab_size);
      if (r.has_value()) {
        rkeys[populated] = *r;
      } else {
        failed = r.error();
      }
    }
  }

  lock.Lock();
  WarnMlockFailed(mlock_errno);
  if (!failed.ok()) {  // all or nothing: undo this grant
    for (size_t i = 0; i < count; ++i) {
      const uint32_t index = picked[i];
      // The one that failed is not registered; those before it are.
      if (registrar != nullptr && i + 1 < populated) registrar->DeregisterLease(index);
      slabs_[index].granting = false;
      if (i < populated) ReturnMemory(index);
      free_list_.push_back(index);
    }
    if (grant_budget_.has_value()) *grant_budget_ += count;
    return Err(failed);
  }
  const auto expiry = std::chrono::steady_clock::now() + options_.lease_ttl;
  std::vector<wire::LeaseGrant> out;
  out.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t index = picked[i];
    uint8_t* addr = base_ + uint64_t{index} * options_.slab_size;
    if (++next_epoch_ == 0) next_epoch_ = 1;
    Slab& s = slabs_[index];
    s.granting = false;
    s.expiry = expiry;
    s.accesses.store(0, std::memory_order_relaxed);
    s.accesses_seen = 0;
    s.evict_at = {};
    const uint64_t id = wire::MakeLeaseId(next_epoch_, index);
    s.lease_id.store(id, std::memory_order_seq_cst);
    out.push_back({id, options_.slab_size, reinterpret_cast<uint64_t>(addr), rkeys[i]});
  }
  granted_total_ += count;
  if (collapser_.joinable() && registrar == nullptr && !collapse_unsupported_) {
    bool queued = false;
    for (uint32_t i = 0; i < count; ++i) {
      // Only populated slabs: a collapse would populate an unpopulated one (--no-prefault).
      if (!slabs_[picked[i]].locked && !options_.prefault) continue;
      collapse_queue_.emplace_back(picked[i], out[i].lease_id);
      queued = true;
    }
    if (queued) collapse_cv_.Signal();
  }
  return out;
}

uint32_t SlabPool::Grantable() const {
  const uint32_t free = static_cast<uint32_t>(free_list_.size());
  return grant_budget_.has_value() ? std::min(free, *grant_budget_) : free;
}

void SlabPool::WarnMlockFailed(int mlock_errno) {
  if (mlock_errno == 0 || warned_mlock_) return;
  warned_mlock_ = true;
  spdlog::warn(
      "could not mlock a slab ({}): lent memory may be swapped out; raise RLIMIT_MEMLOCK "
      "(LimitMEMLOCK=infinity in systemd), run as root, or pass --no-mlock",
      strerror(mlock_errno));
}

int SlabPool::Populate(uint32_t index) {
  Slab& s = slabs_[index];
  if (s.populated) return 0;
  uint8_t* addr = base_ + uint64_t{index} * options_.slab_size;
  int mlock_errno = 0;
  if (options_.mlock) {
    if (::mlock(addr, options_.slab_size) == 0) {  // also faults every page in
      s.locked = true;
    } else {
      mlock_errno = errno;
    }
  }
  if (!s.locked && options_.prefault) {
#ifdef MADV_POPULATE_WRITE
    if (::madvise(addr, options_.slab_size, MADV_POPULATE_WRITE) != 0)
#endif
    {
      for (uint64_t off = 0; off < options_.slab_size; off += 4096) addr[off] = 0;
    }
  }
  s.populated = true;
  return mlock_errno;
}

void SlabPool::ReturnMemory(uint32_t index) {
  Slab& s = slabs_[index];
  uint8_t* addr = base_ + uint64_t{index} * options_.slab_size;
  if (options_.populate_at_start) {  // the prefaulted pool keeps its memory: zero it in place
    std::memset(addr, 0, options_.slab_size);
    return;
  }
  if (s.locked) {
    (void)::munlock(addr, options_.slab_size);
    s.locked = false;
  }
  // Private anonymous memory reads as zeros after MADV_DONTNEED: this is the zeroing too.
  if (::madvise(addr, options_.slab_size, MADV_DONTNEED) != 0) {
    spdlog::warn("MADV_DONTNEED on slab {}: {}; zeroing it instead (its memory stays in use)",
                 index, strerror(errno));
    std::memset(addr, 0, options_.slab_size);
  }
  s.populated = false;
}

uint32_t SlabPool::HeldBy(const wire::ClientId& owner) const {
  uint32_t held = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    const Slab& s = slabs_[i];
    if ((s.lease_id.load(std::memory_order_relaxed) != 0 || s.granting) && s.owner == owner) {
      ++held;
    }
  }
  return held;
}

void SlabPool::EndLease(uint32_t index) {
  Slab& s = slabs_[index];
  s.lease_id.store(0, std::memory_order_seq_cst);
  if (registrar_ != nullptr) registrar_->DeregisterLease(index);
  draining_.push_back(index);
  ReclaimDrained();
}

void SlabPool::ReclaimDrained() {
  for (size_t i = 0; i < draining_.size();) {
    const uint32_t index = draining_[i];
    if (slabs_[index].users.load(std::memory_order_seq_cst) != 0) {
      ++i;
      continue;
    }
    ReturnMemory(index);
    slabs_[index].owner = {};  // only now: an Acquire that raced the end may still read it
    free_list_.push_back(index);
    draining_[i] = draining_.back();
    draining_.pop_back();
  }
}

Status SlabPool::Release(std::span<const uint64_t> lease_ids, const wire::ClientId& owner) {
  MutexLock lock(&mu_);
  for (uint64_t id : lease_ids) {
    const uint32_t index = wire::LeaseSlab(id);
    // Epoch 0 is never granted: lease id 0 must not match a free slab (whose id is 0).
    if (index >= total_ || wire::LeaseEpoch(id) == 0 || slabs_[index].lease_id.load() != id) {
      return Expired(
          fmt::format("lease {:#x} is not held (already freed, expired or evicted)", id));
    }
    if (slabs_[index].owner != owner) {
      return PermissionDenied(fmt::format("lease {:#x} belongs to another client", id));
    }
  }
  for (uint64_t id : lease_ids) {
    // A list may name the same lease twice: the second time it is already gone.
    if (slabs_[wire::LeaseSlab(id)].lease_id.load() == id) EndLease(wire::LeaseSlab(id));
  }
  return Status::Ok();
}

uint32_t SlabPool::Renew(const wire::ClientId& owner, std::vector<wire::NoticedLease>* noticed) {
  MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  const auto expiry = now + options_.lease_ttl;
  uint32_t held = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    Slab& s = slabs_[i];
    const uint64_t id = s.lease_id.load(std::memory_order_relaxed);
    if (id == 0 || s.owner != owner) continue;
    s.expiry = expiry;
    ++held;
    if (noticed != nullptr && s.evict_at != std::chrono::steady_clock::time_point{}) {
      // Rounded up: 0 ms only once the deadline has passed (it ends at the reclaimer's next round).
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(
          std::max(s.evict_at - now, std::chrono::steady_clock::duration::zero()));
      noticed->push_back({id, static_cast<uint32_t>(std::min<int64_t>(left.count(), UINT32_MAX))});
    }
  }
  if (noticed != nullptr && noticed->size() > wire::kMaxLeasesPerCall) {
    std::ranges::nth_element(*noticed, noticed->begin() + wire::kMaxLeasesPerCall, {},
                             &wire::NoticedLease::grace_left_ms);
    noticed->resize(wire::kMaxLeasesPerCall);
  }
  return held;
}

uint32_t SlabPool::ReclaimExpired() {
  MutexLock lock(&mu_);
  ReclaimDrained();
  const auto now = std::chrono::steady_clock::now();
  uint32_t reclaimed = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    Slab& s = slabs_[i];
    const uint64_t id = s.lease_id.load(std::memory_order_relaxed);
    if (id != 0 && s.expiry < now) {
      spdlog::info(
          "lease {:#x} (slab {}) expired: its client stopped heartbeating; reclaimed and "
          "zeroed",
          id, i);
      EndLease(i);
      ++reclaimed;
    }
  }
  expired_total_ += reclaimed;
  return reclaimed;
}

Result<Pin> SlabPool::Acquire(uint64_t lease_id, const wire::ClientId& owner, uint64_t offset,
                              uint64_t length) {
  const uint32_t index = wire::LeaseSlab(lease_id);
  if (wire::LeaseEpoch(lease_id) == 0) {  // never granted; and a free slab's id is 0
    return Err(NotFound(fmt::format("lease {:#x} was never granted (epoch 0)", lease_id)));
  }
  if (index >= total_) {
    return Err(NotFound(
        fmt::format("lease {:#x} names slab {} but this daemon has {}", lease_id, index, total_)));
  }
  Slab& s = slabs_[index];
  s.users.fetch_add(1, std::memory_order_seq_cst);
  Pin pin(&s.users, base_ + uint64_t{index} * options_.slab_size);
  if (s.lease_id.load(std::memory_order_seq_cst) != lease_id) {
    return Err(
        Expired(fmt::format("lease {:#x} is not held (freed, expired or evicted)", lease_id)));
  }
  if (s.owner != owner) {
    return Err(PermissionDenied(fmt::format("lease {:#x} belongs to another client", lease_id)));
  }
  if (!wire::RangeFits(offset, length, options_.slab_size)) {
    return Err(OutOfRange(fmt::format("{} bytes at offset {} fall outside lease {:#x} of {} bytes",
                                      length, offset, lease_id, options_.slab_size)));
  }
  if (options_.count_served_accesses) s.accesses.fetch_add(1, std::memory_order_relaxed);
  return Pin(std::move(pin));
}

void SlabPool::SetRegistrar(LeaseRegistrar* registrar) {
  MutexLock lock(&mu_);
  registrar_ = registrar;
}

SlabPool::ClientRoom SlabPool::RoomFor(const wire::ClientId& owner) const {
  MutexLock lock(&mu_);
  const uint32_t held = HeldBy(owner);
  const uint32_t left = held >= max_client_slabs_ ? 0 : max_client_slabs_ - held;
  // What the pool would grant now: nothing while draining, less under pressure (grant budget).
  const uint32_t grantable = draining_mode_ ? 0u : Grantable();
  return {std::min(left, grantable), max_client_slabs_};
}

PoolStats SlabPool::stats() const {
  MutexLock lock(&mu_);
  PoolStats st{mapped_, options_.slab_size, total_, draining_mode_ ? 0u : Grantable()};
  for (uint32_t i = 0; i < total_; ++i) {
    if (slabs_[i].lease_id.load(std::memory_order_relaxed) == 0) continue;
    ++st.leased_slabs;
    if (slabs_[i].evict_at != std::chrono::steady_clock::time_point{}) ++st.noticed_slabs;
  }
  st.draining = draining_mode_;
  st.holding = HoldingLocked();
  st.expired_leases = expired_total_;
  st.evicted_leases = evicted_total_;
  st.granted_leases = granted_total_;
  st.huge_page_slabs = huge_page_slabs_;
  st.huge_page_failures = huge_page_failures_;
  st.huge_page_skips = huge_page_skips_;
  return st;
}

std::map<wire::ClientId, uint32_t> SlabPool::LeasesByOwner() const {
  MutexLock lock(&mu_);
  std::map<wire::ClientId, uint32_t> held;
  for (uint32_t i = 0; i < total_; ++i) {
    if (slabs_[i].lease_id.load(std::memory_order_relaxed) != 0) ++held[slabs_[i].owner];
  }
  return held;
}

void SlabPool::SetGrantBudget(std::optional<uint32_t> slabs) {
  MutexLock lock(&mu_);
  grant_budget_ = slabs;
}

void SlabPool::SetDraining(bool draining) {
  MutexLock lock(&mu_);
  draining_mode_ = draining;
}

bool SlabPool::draining() const {
  MutexLock lock(&mu_);
  return draining_mode_;
}

std::vector<LeaseActivity> SlabPool::SampleLeases(uint32_t n, uint64_t seed) {
  MutexLock lock(&mu_);
  std::vector<uint32_t> candidates;
  for (uint32_t i = 0; i < total_; ++i) {
    const Slab& s = slabs_[i];
    if (s.lease_id.load(std::memory_order_relaxed) != 0 &&
        s.evict_at == std::chrono::steady_clock::time_point{}) {
      candidates.push_back(i);
    }
  }
  std::mt19937_64 rng(seed);
  const size_t take = std::min<size_t>(n, candidates.size());
  // Partial Fisher-Yates: the first `take` entries become a uniform random sample.
  for (size_t i = 0; i < take; ++i) {
    std::swap(candidates[i],
              candidates[std::uniform_int_distribution<size_t>(i, candidates.size() - 1)(rng)]);
  }
  std::vector<LeaseActivity> out;
  out.reserve(take);
  for (size_t i = 0; i < take; ++i) {
    Slab& s = slabs_[candidates[i]];
    const uint64_t now = s.accesses.load(std::memory_order_relaxed);
    out.push_back(
        {candidates[i], s.lease_id.load(std::memory_order_relaxed), now - s.accesses_seen});
    s.accesses_seen = now;
  }
  return out;
}

uint32_t SlabPool::CreditAccesses(const wire::ClientId& owner,
                                  std::span<const wire::AccessReport> reports) {
  MutexLock lock(&mu_);  // the owner check reads Slab::owner, written under mu_ at grant
  uint32_t credited = 0;
  for (const wire::AccessReport& r : reports) {
    const uint32_t index = wire::LeaseSlab(r.lease_id);
    // Epoch 0 was never granted (and a free slab's id is 0).
    if (wire::LeaseEpoch(r.lease_id) == 0 || index >= total_ || r.accesses == 0) continue;
    Slab& s = slabs_[index];
    if (s.lease_id.load(std::memory_order_relaxed) != r.lease_id || s.owner != owner) continue;
    // Saturating: a hostile count must not wrap the slab to "idle".
    const uint64_t now = s.accesses.load(std::memory_order_relaxed);
    const uint64_t add = std::min(r.accesses, UINT64_MAX - now);
    s.accesses.fetch_add(add, std::memory_order_relaxed);
    ++credited;
  }
  return credited;
}

std::vector<EvictionNotice> SlabPool::NoticeEviction(
    std::optional<std::span<const uint64_t>> lease_ids,
    std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(&mu_);
  const auto grace =
      std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  const uint32_t grace_ms =
      static_cast<uint32_t>(std::clamp<int64_t>(grace.count(), 0, UINT32_MAX));
  std::map<wire::ClientId, std::vector<uint64_t>> by_owner;
  auto mark = [&](uint32_t index) {
    Slab& s = slabs_[index];
    const uint64_t id = s.lease_id.load(std::memory_order_relaxed);
    if (id == 0 || s.evict_at != std::chrono::steady_clock::time_point{}) return;
    s.evict_at = deadline;
    by_owner[s.owner].push_back(id);
  };
  if (lease_ids.has_value()) {
    for (uint64_t id : *lease_ids) {
      const uint32_t index = wire::LeaseSlab(id);
      if (index < total_ && slabs_[index].lease_id.load(std::memory_order_relaxed) == id) {
        mark(index);
      }
    }
  } else {
    for (uint32_t i = 0; i < total_; ++i) mark(i);
  }
  std::vector<EvictionNotice> out;
  for (auto& [owner, ids] : by_owner) out.push_back({owner, std::move(ids), grace_ms});
  return out;
}

uint32_t SlabPool::EvictDue() {
  MutexLock lock(&mu_);
  ReclaimDrained();
  const auto now = std::chrono::steady_clock::now();
  uint32_t evicted = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    Slab& s = slabs_[i];
    const uint64_t id = s.lease_id.load(std::memory_order_relaxed);
    if (id == 0 || s.evict_at == std::chrono::steady_clock::time_point{} || s.evict_at > now) {
      continue;
    }
    spdlog::info(
        "lease {:#x} (slab {}) evicted: its client did not free it by the EVICT_NOTICE deadline; "
        "its memory is returned to the host",
        id, i);
    EndLease(i);
    ++evicted;
  }
  evicted_total_ += evicted;
  return evicted;
}

void SlabPool::CancelNotices() {
  MutexLock lock(&mu_);
  for (uint32_t i = 0; i < total_; ++i) slabs_[i].evict_at = {};
}

}  // namespace farmem::daemon
