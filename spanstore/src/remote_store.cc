// RemoteStore setup, row/group bookkeeping, noting failures (MarkFailed, cluster events) and the
// recovery thread's loop. Re-protecting a group (Reprotect) and the periodic reconcile are in
// remote_store_recovery.cc; the data path (WriteSet, ReadSpan, RunOps) in remote_store_io.cc.
#include "farmem/spanstore/remote_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <cstring>

namespace farmem::spanstore {

RemoteStore::RemoteStore(client::Cluster* cluster, client::Resilience res, uint32_t span_size,
                         std::chrono::milliseconds op_timeout,
                         std::chrono::milliseconds reconcile_interval, bool lease_ahead)
    : cluster_(cluster),
      res_(res),
      span_size_(span_size),
      op_timeout_(op_timeout),
      reconcile_interval_(std::max(reconcile_interval, std::chrono::milliseconds(10))),
      lease_ahead_(lease_ahead) {}

Result<std::unique_ptr<RemoteStore>> RemoteStore::Create(
    client::Cluster* cluster, client::Resilience res, uint32_t span_size,
    std::chrono::milliseconds op_timeout, std::chrono::milliseconds reconcile_interval,
    bool lease_ahead) {
  std::unique_ptr<RemoteStore> s(
      new RemoteStore(cluster, res, span_size, op_timeout, reconcile_interval, lease_ahead));
  FARMEM_RETURN_IF_ERROR(s->Init());
  return s;
}

Status RemoteStore::Init() {
  if (res_.group_size() > kMaxSetWidth) {
    return InvalidArgument(
        fmt::format("resilience {} spreads a span set over {} daemons; at most "
                    "{} are supported",
                    res_.ToString(), res_.group_size(), kMaxSetWidth));
  }
  if (static_cast<size_t>(res_.group_size()) > cluster_->node_count()) {
    return InvalidArgument(fmt::format("resilience {} needs {} daemons, the cluster has {}",
                                       res_.ToString(), res_.group_size(), cluster_->node_count()));
  }
  if (res_.mode == client::Resilience::Mode::kErasure && res_.r > 0) {
    FARMEM_ASSIGN_OR_RETURN(codec_, ec::ReedSolomon::Create(res_.k, res_.r));
    // Every degraded read's decode plan now, not on a request path (swap safety).
    if (Result<size_t> plans = codec_->PrepareReconstructPlans(); !plans) {
      spdlog::warn("far memory: {}", plans.error().message());
    }
  }
  for (client::NodeId id = 0; id < cluster_->node_count() && slab_size_ == 0; ++id) {
    if (auto st = cluster_->Stat(id)) slab_size_ = st->slab_size;
  }
  if (slab_size_ == 0) return Unavailable("no daemon answered STAT: cannot learn the slab size");
  if (slab_size_ < span_size_) {
    return InvalidArgument(fmt::format("span size {} exceeds the daemons' slab size {}",
                                       FormatSize(span_size_), FormatSize(slab_size_)));
  }
  rows_per_group_ = static_cast<uint32_t>(slab_size_ / span_size_);
  live_words_ = (rows_per_group_ + 63) / 64;
  zeros_.assign(span_size_, 0);
  subscription_ = cluster_->Subscribe([this](const client::Event& ev) { OnClusterEvent(ev); });
  recovery_thread_ = std::thread([this] { RecoveryLoop(); });
  return Status::Ok();
}

RemoteStore::~RemoteStore() { Shutdown(); }

void RemoteStore::Shutdown() {
  if (subscription_ != 0) {
    cluster_->Unsubscribe(subscription_);
    subscription_ = 0;
  }
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  recovery_cv_.SignalAll();
  if (recovery_thread_.joinable()) recovery_thread_.join();
  std::vector<client::Lease> leases;
  {
    MutexLock lock(&mu_);
    for (auto& g : groups_) {
      for (const auto& l : g->members) {
        if (!Vacant(l)) leases.push_back(l);
      }
    }
    groups_.clear();
    by_lease_.clear();
  }
  if (!leases.empty()) (void)cluster_->Free(leases);
}

// ---------------------------------------------------------------------------------------------
// Rows and groups

SpanSet* RemoteStore::TakeRowLocked(bool degraded, SetMembers* members, uint64_t* epoch,
                                    uint32_t* absent) {
  Group* best = nullptr;
  uint64_t free_complete = 0;  // the complete groups' free rows, for the lease ahead below
  for (auto& g : groups_) {
    if (g->TakesCompleteSets()) free_complete += rows_per_group_ - g->used_rows;
    // A group with a leaving member (noticed for eviction) takes no new rows: they would only
    // have to be moved too.
    if (g->rebuilding || g->leaving_mask != 0 || g->used_rows >= rows_per_group_) continue;
    if (degraded) {
      // Missing members, but enough of them to write (and later rebuild) a set.
      if (g->lost_mask != 0 || g->failed_mask == 0) continue;
      if (res_.group_size() - std::popcount(g->failed_mask) < MinMembers()) continue;
    } else if (g->failed_mask != 0 || g->lost_mask != 0) {
      continue;
    }
    if (best == nullptr || g->used_rows > best->used_rows) best = g.get();
  }
  if (best == nullptr) return nullptr;
  uint32_t row = best->first_free;
  while (best->sets[row].group != nullptr) ++row;
  best->first_free = row + 1;
  SpanSet* set = &best->sets[row];  // made with the group, clean (FreeRowLocked): no allocation
  set->group = best;
  set->id = next_set_id_++;
  ++best->used_rows;
  ++sets_;
  best->CopyMembers(members);
  *epoch = best->epoch;
  *absent = best->failed_mask | best->lost_mask;
  // The next group before this one is full: half a group of rows is time enough to place it
  // at any write rate the data path reaches (k + r ALLOCs take tens of milliseconds). Not
  // degraded: best is a complete group, and the row just taken was one of free_complete.
  if (lease_ahead_ && !degraded && !lease_ahead_wanted_ && !lease_ahead_failed_ &&
      free_complete - 1 < rows_per_group_ / 2) {
    lease_ahead_wanted_ = true;
    recovery_cv_.SignalAll();
  }
  return set;
}

uint64_t RemoteStore::FreeCompleteRowsLocked() const {
  uint64_t free_rows = 0;
  for (const auto& g : groups_) {
    if (g->TakesCompleteSets()) free_rows += rows_per_group_ - g->used_rows;
  }
  return free_rows;
}

void RemoteStore::LeaseAhead() {
  // A writer placing a group now places the one this would: nothing to do.
  if (!alloc_mu_.TryLock()) return;
  MutexLock alloc(&alloc_mu_, kAdoptLock);
  {
    MutexLock lock(&mu_);
    if (stopping_ || FreeCompleteRowsLocked() >= rows_per_group_ / 2) return;
  }
  Result<std::vector<client::Lease>> leases =
      cluster_->AllocateGroup(static_cast<size_t>(res_.group_size()));
  if (!leases) {
    // No room for a complete group: a writer that needs one finds out itself (and places a
    // degraded one if it may). Not tried again until a daemon comes up or the next tick.
    spdlog::debug("far memory: leasing the next slab group ahead: {}", leases.error().ToString());
    MutexLock lock(&mu_);
    lease_ahead_failed_ = true;
    return;
  }
  AddGroup(std::move(*leases));
  MutexLock lock(&mu_);
  ++groups_leased_ahead_;
}

Result<SpanSet*> RemoteStore::ReserveRow(bool allow_degraded, SetMembers* members, uint64_t* epoch,
                                         uint32_t* absent) {
  *absent = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    {
      MutexLock lock(&mu_);
      if (SpanSet* set = TakeRowLocked(false, members, epoch, absent)) return set;
      // While complete groups cannot be had, degraded ones with room take rows before another
      // attempt at a complete group (re-protection completes them as daemons appear).
      if (allow_degraded && full_alloc_failed_) {
        if (SpanSet* set = TakeRowLocked(true, members, epoch, absent)) return set;
      }
    }
    // No room: one thread allocates a group while the others wait and then look again.
    if (!alloc_mu_.TryLock()) {
      MutexLock wait(&alloc_mu_);
      continue;
    }
    MutexLock alloc(&alloc_mu_, kAdoptLock);
    Result<std::vector<client::Lease>> leases =
        cluster_->AllocateGroup(static_cast<size_t>(res_.group_size()));
    if (!leases) {
      if (!allow_degraded) return Err(leases.error());
      {
        MutexLock lock(&mu_);
        full_alloc_failed_ = true;
        if (SpanSet* set = TakeRowLocked(true, members, epoch, absent)) return set;
      }
      leases = AllocateDegraded(leases.error());
      if (!leases) return Err(leases.error());
    } else {
      MutexLock lock(&mu_);
      full_alloc_failed_ = false;
    }
    AddGroup(std::move(*leases));
    {
      MutexLock lock(&mu_);
      ++groups_leased_by_writers_;
    }
    attempt = -1;  // the new group has room: take a row from it
  }
  return Err(Internal("no span-set row after allocating a group"));
}

Result<std::vector<client::Lease>> RemoteStore::AllocateDegraded(const Status& full_error) {
  const int n = res_.group_size();
  const int min = MinMembers();
  Status last = full_error;
  const int alive = static_cast<int>(cluster_->alive_count());
  for (int m = std::min(n - 1, alive); m >= min; --m) {
    Result<std::vector<client::Lease>> got = cluster_->AllocateGroup(static_cast<size_t>(m));
    if (!got) {
      last = got.error();
      continue;
    }
    // Data members first: vacant ones are parity (or extra copies) while possible, so reads
    // need no decoding until a data member's daemon fails too.
    std::vector<client::Lease> leases = std::move(*got);
    leases.resize(static_cast<size_t>(n));  // default Leases: vacant
    spdlog::warn(
        "far memory: a slab group of {} ({}) got only {} of {} daemons ({}); span sets go there "
        "degraded until re-protection places the missing members",
        FormatSize(slab_size_ * static_cast<uint64_t>(n)), res_.ToString(), m, n,
        full_error.message());
    return leases;
  }
  // Too few daemons up is an outage, not a full cluster: Unavailable (EIO to an NBD client, not
  // ENOSPC, which would send its user looking for space rather than for the daemons that are down).
  const StatusCode code = alive < min ? StatusCode::kUnavailable
                          : last.code() == StatusCode::kInvalidArgument
                              ? StatusCode::kResourceExhausted
                              : last.code();
  return Err(Status(
      code, fmt::format("a span set ({}) needs at least {} of its {} daemons with "
                        "room; {} of {} are up: {}",
                        res_.ToString(), min, n, alive, cluster_->node_count(), last.message())));
}

void RemoteStore::AddGroup(std::vector<client::Lease> leases) {
  std::vector<uint64_t> daemon_ids(leases.size(), 0);
  for (size_t m = 0; m < leases.size(); ++m) {
    if (!Vacant(leases[m])) daemon_ids[m] = cluster_->node(leases[m].node).daemon_id;
  }
  const Clock::time_point now = Clock::now();
  MutexLock lock(&mu_);
  auto g = std::make_unique<Group>();
  g->id = next_group_id_++;
  g->members = std::move(leases);
  g->daemon_ids = std::move(daemon_ids);
  g->failed_since.assign(g->members.size(), now);
  const size_t k = static_cast<size_t>(res_.k);
  g->sets = std::make_unique<SpanSet[]>(rows_per_group_);
  g->owners = std::make_unique<SpanOwner*[]>(rows_per_group_ * k);  // value-initialized: null
  for (uint32_t r = 0; r < rows_per_group_; ++r) {
    g->sets[r].row = r;
    g->sets[r].spans = &g->owners[r * k];
  }
  g->by_live = std::make_unique<uint64_t[]>(live_words_ * k);  // value-initialized: no row
  for (size_t m = 0; m < g->members.size(); ++m) {
    if (Vacant(g->members[m])) {
      g->failed_mask |= 1u << m;
    } else {
      by_lease_[g->members[m].id()] = {g.get(), static_cast<int>(m)};
    }
  }
  if (g->failed_mask != 0) {
    NoteDegradedLocked();  // placed with members missing: a degraded mapping
    QueueLocked(g.get());
  }
  groups_.push_back(std::move(g));
  members_epoch_.fetch_add(1, std::memory_order_release);
  recovery_cv_.SignalAll();
}

std::vector<client::Lease> RemoteStore::RemoveGroupLocked(Group* g) {
  std::vector<client::Lease> to_free;
  for (const auto& l : g->members) {
    if (Vacant(l)) continue;
    to_free.push_back(l);
    by_lease_.erase(l.id());
  }
  std::erase_if(recovery_queue_, [g](Group* q) { return q == g; });
  ForgetMovesLocked(g);
  std::erase_if(groups_, [g](const std::unique_ptr<Group>& p) { return p.get() == g; });
  return to_free;
}

std::string RemoteStore::MemberName(const client::Lease& l) const {
  if (Vacant(l)) return "(never placed: too few daemons)";
  return cluster_->node(l.node).endpoint.ToString();
}

uint32_t RemoteStore::DataCells(std::span<const uint8_t* const> data, const uint8_t** cells) const {
  uint32_t live = 0;
  for (int m = 0; m < res_.k; ++m) {
    const uint8_t* d =
        static_cast<size_t>(m) < data.size() ? data[static_cast<size_t>(m)] : nullptr;
    cells[m] = d != nullptr ? d : zeros_.data();
    if (d != nullptr) live |= 1u << m;
  }
  return live;
}

void RemoteStore::SetLiveLocked(SpanSet* set, uint32_t live) {
  uint64_t* by_live = set->group->by_live.get();
  const size_t word = set->row / 64;
  const uint64_t bit = uint64_t{1} << (set->row % 64);
  if (const int was = std::popcount(set->live_mask); was > 0) {
    by_live[static_cast<size_t>(was - 1) * live_words_ + word] &= ~bit;
  }
  if (const int now = std::popcount(live); now > 0) {
    by_live[static_cast<size_t>(now - 1) * live_words_ + word] |= bit;
  }
  set->live_mask = live;
}

void RemoteStore::CommitRowLocked(SpanSet* set, uint32_t live, std::span<SpanOwner* const> spans) {
  set->writing = false;
  SetLiveLocked(set, live);
  for (size_t i = 0; i < spans.size(); ++i) {
    set->spans[i] = (live >> i & 1) != 0 ? spans[i] : nullptr;
  }
}

bool RemoteStore::LiveIndexConsistent() const {
  MutexLock lock(&mu_);
  for (const auto& g : groups_) {
    for (uint32_t r = 0; r < rows_per_group_; ++r) {
      const SpanSet& set = g->sets[r];
      const int live = set.group != nullptr ? std::popcount(set.live_mask) : 0;
      for (int c = 1; c <= res_.k; ++c) {
        const uint64_t word = g->by_live[static_cast<size_t>(c - 1) * live_words_ + r / 64];
        if (((word >> (r % 64) & 1) != 0) != (live == c)) return false;
      }
    }
  }
  return true;
}

void RemoteStore::FreeRowLocked(SpanSet* set) {
  Group* g = set->group;
  g->first_free = std::min(g->first_free, set->row);
  --g->used_rows;
  --sets_;
  // Clean for the row's next set (TakeRowLocked sets only what differs); row and spans stay.
  SetLiveLocked(set, 0);
  set->group = nullptr;
  set->id = 0;
  set->writing = true;
  std::fill_n(set->spans, res_.k, nullptr);
}

void RemoteStore::Release(SpanSet* set, int member) {
  std::vector<client::Lease> to_free;
  {
    MutexLock lock(&mu_);
    SetLiveLocked(set, set->live_mask & ~(1u << member));
    set->spans[static_cast<size_t>(member)] = nullptr;
    if (set->live_mask != 0) return;
    Group* g = set->group;
    FreeRowLocked(set);
    if (g->used_rows != 0) return;
    if (g->rebuilding || g->in_recovery) {
      g->release_wanted = true;  // the recovery thread frees it when done
      return;
    }
    to_free = RemoveGroupLocked(g);
  }
  if (Status s = cluster_->Free(to_free); !s.ok()) {
    spdlog::debug("far memory: freeing an empty slab group: {}", s.ToString());
  }
}

bool RemoteStore::Healthy(const SpanSet* set) const {
  MutexLock lock(&mu_);
  const Group* g = set->group;
  // A leaving member (noticed, not yet moved) still counts: it is readable until it is moved,
  // and a clean copy dropped now is no worse off than one written anew (both need a daemon with
  // room). Counting it would turn every clean eviction from its groups into a write while a
  // drain runs.
  return g->failed_mask == 0 && g->lost_mask == 0 && !g->rebuilding;
}

void RemoteStore::OpenChannels(IoContext& io) {
  const uint64_t epoch = members_epoch_.load(std::memory_order_acquire);
  if (io.channels_epoch == epoch) return;
  // Each daemon once: the list is as long as the cluster, not as the groups (it was one entry per
  // member, and grew, i.e. allocated on the compactor's path, whenever groups were added).
  std::vector<client::NodeId>& nodes = io.open_scratch;
  nodes.clear();
  nodes.reserve(cluster_->node_count());  // allocates only the first time and as daemons join
  {
    MutexLock lock(&mu_);
    for (auto& g : groups_) {
      for (size_t m = 0; m < g->members.size(); ++m) {
        const client::NodeId node = g->members[m].node;
        if (!Vacant(g->members[m]) && (g->failed_mask & (1u << m)) == 0 &&
            std::find(nodes.begin(), nodes.end(), node) == nodes.end()) {
          nodes.push_back(node);
        }
      }
    }
  }
  for (client::NodeId node : nodes) {
    Status error;
    (void)io.channels.Get(node, &error);
  }
  io.channels_epoch = epoch;  // a member placed meanwhile bumped it again: the next call looks
}

void RemoteStore::CompactionCandidates(size_t max_spans, std::vector<SpanOwner*>* candidates) {
  MutexLock lock(&mu_);
  // Allocates nothing (the caller's vector has room for max_spans, reserved at its start): the
  // emptiest sets first, one pass over the groups' by_live bitmaps per live-cell count (k - 1
  // passes at most, each stopping once max_spans are taken).
  std::vector<SpanOwner*>& out = *candidates;
  out.clear();
  uint64_t used_rows = 0;
  uint64_t groups_in_use = 0;  // not the one leased ahead (empty): nothing there to move
  for (auto& g : groups_) {
    used_rows += g->used_rows;
    groups_in_use += g->used_rows != 0 ? 1 : 0;
  }
  auto take = [&](SpanSet* set) {
    for (int m = 0; m < res_.k && out.size() < max_spans; ++m) {
      if (set->spans[static_cast<size_t>(m)] != nullptr) {
        out.push_back(set->spans[static_cast<size_t>(m)]);
      }
    }
  };
  // The rows of g with `live` live members, lowest first, until max_spans are taken.
  auto take_rows = [&](Group* g, int live) {
    const uint64_t* bits = &g->by_live[static_cast<size_t>(live - 1) * live_words_];
    for (size_t w = 0; w < live_words_ && out.size() < max_spans; ++w) {
      for (uint64_t word = bits[w]; word != 0 && out.size() < max_spans; word &= word - 1) {
        take(&g->sets[w * 64 + static_cast<size_t>(std::countr_zero(word))]);
      }
    }
  };
  for (int live = 1; live < res_.k && out.size() < max_spans; ++live) {
    for (auto& g : groups_) take_rows(g.get(), live);
  }
  // Whole groups are what the daemons get back: if the rows in use would fit in fewer groups,
  // empty the emptiest one.
  const uint64_t needed = (used_rows + rows_per_group_ - 1) / rows_per_group_;
  if (groups_in_use > needed && out.size() < max_spans) {
    Group* emptiest = nullptr;
    for (auto& g : groups_) {
      if (g->rebuilding || g->used_rows == 0) continue;
      if (emptiest == nullptr || g->used_rows < emptiest->used_rows) emptiest = g.get();
    }
    if (emptiest != nullptr) take_rows(emptiest, res_.k);
  }
}

std::vector<std::vector<Endpoint>> RemoteStore::GroupLayout() const {
  std::vector<std::vector<client::Lease>> members;
  {
    MutexLock lock(&mu_);
    for (auto& g : groups_) members.push_back(g->members);
  }
  std::vector<std::vector<Endpoint>> out;
  for (auto& g : members) {
    out.emplace_back();
    for (const client::Lease& l : g) {
      out.back().push_back(Vacant(l) ? Endpoint{} : cluster_->node(l.node).endpoint);
    }
  }
  return out;
}

namespace {
// Milliseconds from `since` to `now`; 0 for an episode clock not started (max()) or ahead of now.
uint64_t ElapsedMs(Clock::time_point since, Clock::time_point now) {
  if (since == Clock::time_point::max() || since > now) return 0;
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count());
}
}  // namespace

RemoteStoreStats RemoteStore::stats() const {
  MutexLock lock(&mu_);
  RemoteStoreStats s;
  s.sets = sets_;
  s.set_bytes = sets_ * static_cast<uint64_t>(res_.group_size()) * span_size_;
  s.groups = groups_.size();
  s.leased_bytes = groups_.size() * static_cast<uint64_t>(res_.group_size()) * slab_size_;
  s.groups_leased_ahead = groups_leased_ahead_;
  s.groups_leased_by_writers = groups_leased_by_writers_;
  s.degraded_reads = degraded_reads_;
  s.members_reprotected = reprotected_;
  s.rebuilt_bytes = rebuilt_bytes_;
  s.sets_reprotected = sets_reprotected_;
  s.lost_bytes = lost_bytes_;
  for (auto& g : groups_) {
    if (g->lost_mask != 0) {
      s.unrecoverable_sets += g->used_rows;
    } else if (g->failed_mask != 0) {
      s.degraded_sets += g->used_rows;
    }
    s.members_missing += static_cast<uint64_t>(std::popcount(g->failed_mask));
    s.empty_groups += g->used_rows == 0 ? 1 : 0;
  }
  s.degraded_sets_written = degraded_sets_written_;
  s.reprotect_last_ms = reprotect_last_ms_;
  s.reprotect_max_ms = reprotect_max_ms_;
  s.members_failed = members_failed_;
  s.members_revalidated = members_revalidated_;
  s.members_moved = moved_;
  s.moved_bytes = moved_bytes_;
  s.move_last_ms = move_last_ms_;
  s.move_last_bytes = move_last_bytes_;
  s.move_max_ms = move_max_ms_;
  s.move_min_slack_ms = move_min_slack_ms_;
  s.moves_pending = moves_.size();
  s.moves_missed = moves_missed_;
  s.copies_abandoned = copies_abandoned_;
  const Clock::time_point now = Clock::now();
  s.degraded_episodes = degraded_episodes_;
  s.episode_degraded_ms = ElapsedMs(degraded_since_, now);
  s.episode_reprotect_ms = ElapsedMs(reprotect_since_, now);
  s.episode_sets_reprotected = episode_sets_;
  s.episode_rebuilt_bytes = episode_bytes_;
  s.last_episode_degraded_ms = last_episode_degraded_ms_;
  s.last_episode_reprotect_ms = last_episode_reprotect_ms_;
  s.last_episode_rebuilt_bytes = last_episode_bytes_;
  return s;
}

void RemoteStore::NoteDegradedLocked() {
  if (degraded_since_ != Clock::time_point::max()) return;
  degraded_since_ = Clock::now();
  ++degraded_episodes_;
}

void RemoteStore::EndEpisodeIfWholeLocked() {
  if (degraded_since_ == Clock::time_point::max()) return;
  bool lost = false;
  for (const auto& g : groups_) {
    if (g->failed_mask != 0) return;
    lost = lost || g->lost_mask != 0;
  }
  const Clock::time_point now = Clock::now();
  last_episode_degraded_ms_ = ElapsedMs(degraded_since_, now);
  last_episode_reprotect_ms_ = ElapsedMs(reprotect_since_, now);
  last_episode_bytes_ = episode_bytes_;
  // Said however the members came back: rebuilt on new leases, or used again as they were (a
  // false down: their daemon answered with the leases), so that whoever watches the log sees the
  // end of every episode (the page store says the same of its extents). Groups that lost members
  // beyond the mode's tolerance are never whole: their loss was logged when it was given up.
  if (!lost) {
    spdlog::info(
        "far memory: every slab group is whole again: {} span sets re-protected, {} written to "
        "new members in {} ms (degraded for {} ms); {} members in use again as they were",
        episode_sets_, FormatSize(episode_bytes_), last_episode_reprotect_ms_,
        last_episode_degraded_ms_, episode_revalidated_);
  }
  degraded_since_ = reprotect_since_ = Clock::time_point::max();
  episode_sets_ = episode_bytes_ = episode_revalidated_ = 0;
}

// ---------------------------------------------------------------------------------------------
// Failures

std::optional<std::pair<Group*, int>> RemoteStore::MemberOfLocked(uint64_t id,
                                                                  client::NodeId node) {
  auto it = by_lease_.find(id);
  if (it == by_lease_.end()) return std::nullopt;
  const auto [g, m] = it->second;
  if (g->members[static_cast<size_t>(m)].node != node) return std::nullopt;
  return it->second;
}

std::vector<uint32_t> RemoteStore::StartRebuildLocked(Group* g) {
  g->rebuilding = true;  // from here, rows committed in g are the ones returned
  std::vector<uint32_t> rows;
  for (uint32_t r = 0; r < rows_per_group_; ++r) {
    if (g->sets[r].group != nullptr && !g->sets[r].writing) rows.push_back(r);
  }
  return rows;
}

void RemoteStore::MarkFailed(Group* g, int m, uint64_t lease_id, const Status& why) {
  bool marked = false;
  {
    MutexLock lock(&mu_);
    marked = MarkFailedLocked(g, m, lease_id, why);
  }
  if (marked) recovery_cv_.SignalAll();
}

bool RemoteStore::MarkFailedLocked(Group* g, int m, uint64_t lease_id, const Status& why) {
  auto it = by_lease_.find(lease_id);
  if (it == by_lease_.end() || it->second.first != g || it->second.second != m) return false;
  const uint32_t bit = 1u << m;
  if ((g->failed_mask & bit) != 0 || (g->lost_mask & bit) != 0) return false;
  g->failed_mask |= bit;
  if ((g->leaving_mask & bit) != 0) ++moves_missed_;  // noticed, not moved: failed instead
  g->leaving_mask &= ~bit;  // a pending move of it gives up: re-protection takes over
  ++members_failed_;
  NoteDegradedLocked();
  g->failed_since[static_cast<size_t>(m)] = Clock::now();
  QueueLocked(g);
  spdlog::warn("far memory: slab group {} member {} ({}, lease {}) failed: {}", g->id, m,
               MemberName(g->members[static_cast<size_t>(m)]), lease_id, why.ToString());
  return true;
}

void RemoteStore::InstallMemberLocked(Group* g, int j, const client::Lease& fresh,
                                      uint64_t daemon_id) {
  const size_t m = static_cast<size_t>(j);
  const uint32_t bit = 1u << j;
  if (!Vacant(g->members[m])) by_lease_.erase(g->members[m].id());
  g->members[m] = fresh;
  g->daemon_ids[m] = daemon_id;
  by_lease_[fresh.id()] = {g, j};
  members_epoch_.fetch_add(1, std::memory_order_release);
  g->failed_mask &= ~bit;
  g->stale_mask &= ~bit;
  g->evicted_mask &= ~bit;
  g->leaving_mask &= ~bit;
  ++g->epoch;
}

bool RemoteStore::RevalidateLocked(Group* g, int m) {
  const uint32_t bit = 1u << m;
  const client::Lease& l = g->members[static_cast<size_t>(m)];
  if (Vacant(l) || (g->failed_mask & bit) == 0 || (g->lost_mask & bit) != 0 ||
      (g->stale_mask & bit) != 0 || g->rebuilding) {
    return false;
  }
  if (cluster_->GetLeaseState(l) != client::LeaseState::kHeld) return false;
  const client::NodeInfo node = cluster_->node(l.node);
  if (!node.alive || node.suspect || node.daemon_id != g->daemon_ids[static_cast<size_t>(m)]) {
    return false;
  }
  g->failed_mask &= ~bit;
  g->degraded_logged = false;
  ++g->epoch;
  ++members_revalidated_;
  ++episode_revalidated_;
  spdlog::info(
      "far memory: slab group {} member {} ({}) is in use again: its daemon answered "
      "with the lease, and no span set was written past it",
      g->id, m, MemberName(l));
  return true;
}

void RemoteStore::QueueLocked(Group* g) {
  if (g->queued) return;
  g->queued = true;
  recovery_queue_.push_back(g);
}

void RemoteStore::OnClusterEvent(const client::Event& ev) {
  if (ev.type == client::EventType::kNodeUp || ev.type == client::EventType::kLeasesLost) {
    // A daemon answers (again, or for the first time, or restarted empty): it may take the
    // members that degraded groups lack, and complete groups may be possible again.
    {
      MutexLock lock(&mu_);
      retry_all_ = true;
      full_alloc_failed_ = false;
      lease_ahead_failed_ = false;
    }
    recovery_cv_.SignalAll();
  }
  if (ev.lease_ids.empty()) return;
  if (ev.type == client::EventType::kLeasesReturned) {
    // Declared down, but the same daemon process answered with these leases: members no
    // re-protection replaced yet and no set went past are used again as they were.
    size_t back = 0;
    {
      MutexLock lock(&mu_);
      for (uint64_t id : ev.lease_ids) {
        auto member = MemberOfLocked(id, ev.node);
        if (member && RevalidateLocked(member->first, member->second)) ++back;
      }
      if (back > 0) EndEpisodeIfWholeLocked();
      retry_all_ = true;  // stale ones: rebuild them now
    }
    spdlog::info("far memory: {} leases came back with their daemon; {} members in use again",
                 ev.lease_ids.size(), back);
    recovery_cv_.SignalAll();
    return;
  }
  if (ev.type == client::EventType::kEvictNotice) {
    // Not a failure: the member stays readable until the deadline and is moved meanwhile.
    OnEvictNotice(ev);
    return;
  }
  if (ev.type != client::EventType::kNodeDown && ev.type != client::EventType::kLeasesLost) {
    return;
  }
  const Status why = ev.reason.ok() ? Unavailable(client::EventTypeName(ev.type)) : ev.reason;
  struct Hit {
    Group* group;
    int member;
    uint64_t lease;
  };
  std::vector<Hit> hits;
  {
    MutexLock lock(&mu_);
    for (uint64_t id : ev.lease_ids) {
      if (auto member = MemberOfLocked(id, ev.node)) {
        hits.push_back({member->first, member->second, id});
      }
    }
  }
  for (const Hit& h : hits) MarkFailed(h.group, h.member, h.lease, why);
}

bool RemoteStore::WaitForRecovery(std::chrono::milliseconds timeout) {
  MutexLock lock(&mu_);
  return recovery_cv_.WaitFor(&mu_, timeout, [&] {
    mu_.AssertHeld();
    if (stopping_) return true;
    if (recovering_) return false;
    return std::none_of(groups_.begin(), groups_.end(), [](const std::unique_ptr<Group>& g) {
      return g->failed_mask != 0 || g->leaving_mask != 0;
    });
  });
}

void RemoteStore::RecoveryLoop() {
  IoContext io(cluster_, op_timeout_);
  MutexLock lock(&mu_);
  Clock::time_point next_reconcile = Clock::now() + reconcile_interval_;
  for (;;) {
    // After every pass (a re-protection, a move, members given up or revalidated, groups
    // emptied): whole again?
    EndEpisodeIfWholeLocked();
    recovery_cv_.WaitUntil(&mu_, std::min(next_reconcile, NextMoveTryLocked()), [&] {
      mu_.AssertHeld();
      return stopping_ || !recovery_queue_.empty() || retry_all_ || lease_ahead_wanted_ ||
             NextMoveTryLocked() <= Clock::now();
    });
    if (stopping_) return;
    if (lease_ahead_wanted_) {
      // Before moves and rebuilds: writers are about to need it, and it takes one ALLOC per
      // member (a rebuild of a whole slab takes far longer).
      lease_ahead_wanted_ = false;
      lock.Unlock();
      LeaseAhead();
      lock.Lock();
      continue;
    }
    const bool tick = Clock::now() >= next_reconcile;
    if (tick || retry_all_) {
      // A daemon came up or freed memory: moves waiting for room try again now.
      for (PendingMove& mv : moves_) mv.next_try = std::min(mv.next_try, Clock::now());
    }
    // Moves first, earliest deadline first: a noticed member not moved in time is lost (none) or
    // leaves its group degraded.
    if (!tick) {
      if (std::optional<PendingMove> mv = TakeDueMoveLocked(Clock::now())) {
        RecoverGroupLocked(mv->group, [&] { Move(io, *mv); });
        continue;
      }
    }
    if (tick) {
      // What events do not tell: a daemon that freed memory (complete groups possible again), a
      // member whose daemon went down or restarted without its event reaching us.
      next_reconcile = Clock::now() + reconcile_interval_;
      full_alloc_failed_ = false;
      lease_ahead_failed_ = false;
      lock.Unlock();
      ReconcileMembers();
      lock.Lock();
      if (stopping_) return;
    }
    if (tick || retry_all_) {
      retry_all_ = false;
      for (auto& g : groups_) {
        if (g->failed_mask != 0) QueueLocked(g.get());
      }
    }
    if (recovery_queue_.empty()) {
      recovery_cv_.SignalAll();
      continue;
    }
    Group* g = recovery_queue_.front();
    recovery_queue_.pop_front();
    g->queued = false;
    if (g->failed_mask == 0) {
      recovery_cv_.SignalAll();
      continue;
    }
    // A group still missing members (no eligible daemon yet) is not retried in a loop: the next
    // node-up event or reconcile tick queues it again.
    RecoverGroupLocked(g, [&] { Reprotect(io, g); });
  }
}

void RemoteStore::RecoverGroupLocked(Group* g, const std::function<void()>& work) {
  g->in_recovery = true;
  recovering_ = true;
  mu_.Unlock();
  work();
  mu_.Lock();
  g->in_recovery = false;
  recovering_ = false;
  // Emptied meanwhile (Release left it to us). A group that never had a row stays: it was
  // just made for a writer that is about to take one.
  if (g->used_rows == 0 && g->release_wanted) {
    std::vector<client::Lease> to_free = RemoveGroupLocked(g);
    mu_.Unlock();
    if (!to_free.empty()) (void)cluster_->Free(to_free);
    mu_.Lock();
  }
  recovery_cv_.SignalAll();
}

}  // namespace farmem::spanstore
