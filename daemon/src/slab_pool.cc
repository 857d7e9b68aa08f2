#include "slab_pool.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <random>
#include <thread>

#include "farmem/common/config.h"

namespace farmem::daemon {

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
  void* p =
      ::mmap(nullptr, pool->mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return Err(ErrnoStatus(StatusCode::kResourceExhausted,
                           fmt::format("mmap of {} for the slab pool", FormatSize(pool->mapped_)),
                           errno));
  }
  pool->base_ = static_cast<uint8_t*>(p);
  if (::madvise(p, pool->mapped_, MADV_HUGEPAGE) != 0) {
    spdlog::info("transparent huge pages not available for the slab pool ({})", strerror(errno));
  }
  bool locked = false;
  if (options.mlock) {
    if (::mlock(p, pool->mapped_) == 0) {
      locked = true;
    } else {
      spdlog::warn(
          "could not mlock the {} slab pool ({}): lent memory may be swapped out; raise "
          "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in systemd) or run as root",
          FormatSize(pool->mapped_), strerror(errno));
    }
  }
  if (!locked && options.prefault) {
    for (uint64_t off = 0; off < pool->mapped_; off += 4096) pool->base_[off] = 0;
  }
  pool->slabs_ = std::make_unique<Slab[]>(slabs);
  {
    MutexLock lock(&pool->mu_);  // not shared yet: uncontended, taken for the analysis
    pool->free_list_.reserve(slabs);
    for (uint32_t i = pool->total_; i > 0; --i) pool->free_list_.push_back(i - 1);
    std::random_device rd;
    pool->next_epoch_ = std::uniform_int_distribution<uint32_t>(1, UINT32_MAX / 2)(rd);
  }
  spdlog::info(
      "slab pool: {} in {} slabs of {}{}; each client may hold {} slab(s) ({}, "
      "--max-client-share {})",
      FormatSize(pool->mapped_), slabs, FormatSize(options.slab_size), locked ? " (mlocked)" : "",
      share_slabs, FormatSize(share_slabs * options.slab_size), share.text);
  return pool;
}

SlabPool::~SlabPool() {
  if (base_ != nullptr) ::munmap(base_, mapped_);
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
  if (count > free_list_.size()) {
    return Err(ResourceExhausted(fmt::format("asked for {} slabs but only {} of {} are free", count,
                                             free_list_.size(), total_)));
  }
  const auto expiry = std::chrono::steady_clock::now() + options_.lease_ttl;
  std::vector<wire::LeaseGrant> out;
  out.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t index = free_list_.back();
    uint8_t* addr = base_ + uint64_t{index} * options_.slab_size;
    uint32_t rkey = 0;
    if (registrar_ != nullptr) {
      Result<uint32_t> r = registrar_->RegisterLease(index, owner, addr, options_.slab_size);
      if (!r.has_value()) {  // all or nothing: undo this grant
        for (const wire::LeaseGrant& g : out) EndLease(wire::LeaseSlab(g.lease_id));
        return Err(r.error());
      }
      rkey = *r;
    }
    free_list_.pop_back();
    if (++next_epoch_ == 0) next_epoch_ = 1;
    Slab& s = slabs_[index];
    s.owner = owner;
    s.expiry = expiry;
    const uint64_t id = wire::MakeLeaseId(next_epoch_, index);
    s.lease_id.store(id, std::memory_order_seq_cst);
    out.push_back({id, options_.slab_size, reinterpret_cast<uint64_t>(addr), rkey});
  }
  return out;
}

uint32_t SlabPool::HeldBy(const wire::ClientId& owner) const {
  uint32_t held = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    const Slab& s = slabs_[i];
    if (s.lease_id.load(std::memory_order_relaxed) != 0 && s.owner == owner) ++held;
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
    std::memset(base_ + uint64_t{index} * options_.slab_size, 0, options_.slab_size);
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

uint32_t SlabPool::Renew(const wire::ClientId& owner) {
  MutexLock lock(&mu_);
  const auto expiry = std::chrono::steady_clock::now() + options_.lease_ttl;
  uint32_t held = 0;
  for (uint32_t i = 0; i < total_; ++i) {
    Slab& s = slabs_[i];
    if (s.lease_id.load(std::memory_order_relaxed) != 0 && s.owner == owner) {
      s.expiry = expiry;
      ++held;
    }
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
  return {std::min(left, static_cast<uint32_t>(free_list_.size())), max_client_slabs_};
}

PoolStats SlabPool::stats() const {
  MutexLock lock(&mu_);
  return {mapped_, options_.slab_size, total_, static_cast<uint32_t>(free_list_.size())};
}

}  // namespace farmem::daemon
