// The extent map: mapping an extent to a group of leases (degraded when daemons are short),
// giving an empty one back.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "page_store.h"
#include "page_store_round.h"

namespace farmem::blockdev {

using namespace pagestore;

// ---------------------------------------------------------------------------------------------
// Mapping

Status PageStore::MapExtent(uint64_t index) {
  Extent& e = *extents_[index];
  MutexLock lock(&map_mu_);  // a leaf lock: never wait on an extent lock while holding it
  if (e.mapped.load(std::memory_order_acquire)) return Status::Ok();
  const Resilience& res = options_.resilience;
  const size_t n = static_cast<size_t>(res.group_size());
  const size_t min = static_cast<size_t>(MinMembers());
  auto context = [&] {
    return fmt::format("mapping extent {} (export bytes {}..{})", index, index * extent_bytes_,
                       index * extent_bytes_ + e.pages * kPage);
  };
  // Member by member on distinct daemons (two-choices each, as AllocateGroup). When fewer daemons
  // than the group size can take a slab (down, still starting, full), the group is mapped
  // degraded on those that can, provided the mode can still read it back; the missing members
  // are placeholders marked failed, re-protected as soon as daemons can take them.
  std::vector<client::Lease> leases;
  std::vector<client::NodeId> used;
  Status why;
  while (leases.size() < n) {
    Result<client::Lease> l = cluster_->AllocateExcluding(used);
    if (!l) {
      why = l.error();
      break;
    }
    used.push_back(l->node);
    leases.push_back(*l);
  }
  if (leases.size() < min) {
    if (!leases.empty()) (void)cluster_->Free(leases);
    return Status(why.code(),
                  fmt::format("{}: resilience {} needs at least {} daemons that can take a slab, "
                              "{} could ({})",
                              context(), res.ToString(), min, leases.size(), why.message()));
  }
  uint32_t vacant = 0;
  for (size_t j = leases.size(); j < n; ++j) {
    client::Lease none;
    none.node = kNoNode;
    leases.push_back(none);  // the parity positions (ec): reads need no decoding
    vacant |= 1u << j;
  }
  e.members = std::move(leases);
  e.failed.store(vacant, std::memory_order_release);
  e.stale.store(0, std::memory_order_release);
  e.mapped.store(true, std::memory_order_release);
  if (vacant != 0) {
    CountStat(&PageStoreStats::degraded_maps);
    NoteDegraded();
    if (uint64_t left_out = 0; DegradedMapLog().Allow(&left_out)) {
      spdlog::warn(
          "page store: {}: mapped degraded on {} of {} daemons ({} survives {} missing), "
          "re-protected as soon as daemons can take the rest: {}{}",
          context(), n - static_cast<size_t>(std::popcount(vacant)), n, res.ToString(), n - min,
          why.ToString(), Suppressed(left_out));
    }
  }
  spdlog::debug("extent {} mapped to {} lease(s)", index, n);
  return Status::Ok();
}

int PageStore::MinMembers() const {
  // With a backup file every write is in the file first, so an extent no daemon can take is
  // mapped with every member vacant: its writes stand in the file, its reads come from there, and
  // re-protection gives it remote members (from the file) once daemons have room (Infiniswap).
  if (!options_.backup_path.empty()) return 0;
  return options_.resilience.min_members();
}

std::vector<client::Lease> PageStore::HeldLeases(std::span<const client::Lease> members) {
  std::vector<client::Lease> out;
  for (const client::Lease& l : members) {
    if (!IsVacant(l)) out.push_back(l);
  }
  return out;
}

std::vector<client::Lease> PageStore::extent_members(uint64_t index) const {
  if (index >= extents_.size()) return {};
  Extent& e = *extents_[index];
  ReaderLock lock(&e.mu);
  if (!e.mapped.load()) return {};
  return e.members;
}

void PageStore::UnmapIfEmpty(uint64_t index) {
  Extent& e = *extents_[index];
  std::vector<client::Lease> freed;
  {
    WriterLock ex(&e.mu);
    MutexLock lock(&map_mu_);
    if (!e.mapped.load() || e.Any()) return;
    e.mapped.store(false, std::memory_order_release);
    freed = HeldLeases(e.members);
    e.members.clear();
    e.failed.store(0);
    e.stale.store(0);
  }
  spdlog::debug("extent {} holds no data any more: its {} lease(s) go back", index, freed.size());
  if (Status s = cluster_->Free(freed); !s.ok()) spdlog::warn("page store: {}", s.ToString());
  NoteMembersChanged();  // a request waiting for this extent's members has nothing to wait for
  // The leases freed may be what a degraded extent was waiting for.
  if (CountDegraded() > 0) RequestReconcile();
}

}  // namespace farmem::blockdev
